"""Work nobody waits for stops: a client that disconnects and a request that times out (504) have
their rows aborted; a failing admission fails only the rows being admitted; a full queue says
when to retry; an answered request is no longer counted as running."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.config.engine_options import EngineOptions
from rollouts.engine import kv as kvops
from rollouts.engine.app import build_core
from rollouts.engine.core import EngineCore, Sequence
from rollouts.engine.rows import SlotTable
from rollouts.engine.sampling import SamplingSpec
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine, completion_request_id
from rollouts.wire.generation import FinishReason, SamplingParams

LONG = {"max_new_tokens": 500, "temperature": 0.0, "ignore_eos": True}  # most of the context


async def _until(predicate, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.005)


async def _load(http: httpx.AsyncClient) -> tuple[int, int]:
    load = (await http.get("/v1/loads")).json()
    return load["num_running_reqs"], load["num_waiting_reqs"]


async def _frozen_long_request(
    http: httpx.AsyncClient, url: str, box: list, prompt: tuple = (5, 6)
) -> None:
    """A long generation on its own connection (the tests freeze it with pause in_place)."""
    body = {"input_ids": list(prompt), "sampling_params": LONG}
    async with httpx.AsyncClient(base_url=url, timeout=60) as own:
        box.append(await own.post("/generate", json=body))


async def _idle(http: httpx.AsyncClient) -> bool:
    return await _load(http) == (0, 0)


async def test_a_disconnected_client_has_its_rows_aborted(fault_servers) -> None:
    """Its row leaves the batch at once (the other row moves into its slot and goes on)."""
    proc = fault_servers["rooted"]
    async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
        gone: list = []
        kept: list = []
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_frozen_long_request, http, proc.url, gone, [5, 6])
                await _until(lambda: _running_is(http, 1))  # slot 0
                outer.start_soon(_frozen_long_request, http, proc.url, kept, [7, 8])
                await _until(lambda: _running_is(http, 2))
                await http.post("/pause_generation", json={"mode": "in_place"})
                nursery.cancel_scope.cancel()  # one client goes away mid-request
            await _until(lambda: _load_is(http, (1, 0)))  # aborted though the server is paused
            await http.post("/continue_generation", json={})
        assert not gone
        answer = kept[0].json()
        assert answer["meta_info"]["finish_reason"]["type"] == "length", answer
    assert "disconnected; aborting its request" in proc.log_tail(20_000)


async def _running_is(http: httpx.AsyncClient, count: int) -> bool:
    return (await _load(http))[0] == count


async def _load_is(http: httpx.AsyncClient, load: tuple[int, int]) -> bool:
    return await _load(http) == load


async def _running(http: httpx.AsyncClient) -> bool:
    return (await _load(http))[0] > 0


async def test_a_timed_out_request_gets_504_and_its_rows_are_aborted(fault_servers) -> None:
    url = fault_servers["short"].url  # --request-timeout-s 2
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        box: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_frozen_long_request, http, url, box)
            await _until(lambda: _running(http))
            await http.post("/pause_generation", json={"mode": "in_place"})
        assert box[0].status_code == 504, box[0].text
        await _until(lambda: _idle(http))
        await http.post("/continue_generation", json={})


async def test_a_full_queue_says_when_to_retry_and_counts_sequences(fault_servers) -> None:
    url = fault_servers["short"].url  # --max-queue 4
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await http.post("/pause_generation", json={"mode": "in_place"})
        first: list = []
        sp = {"max_new_tokens": 2, "n": 3}
        async with trio.open_nursery() as nursery:

            async def three() -> None:
                body = {"input_ids": [1, 2], "sampling_params": sp}
                first.append(await http.post("/generate", json=body))

            nursery.start_soon(three)
            await _until(lambda: _waiting_is(http, 3))
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "n": 2}}
            r = await http.post("/generate", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            message = r.json()["error"]["message"]
            assert "3 sequences wait" in message and "adds 2" in message, message
            await http.post("/continue_generation", json={})
        assert first[0].status_code == 200 and len(first[0].json()) == 3
        r = await http.post("/v1/completions", json={"prompt": [1], "n": 5, "max_tokens": 1})
        assert r.status_code == 400 and "at most 4" in r.text, r.text  # can never fit: no 503


async def _waiting_is(http: httpx.AsyncClient, count: int) -> bool:
    return (await _load(http))[1] == count


async def test_an_answered_request_is_not_counted_running(fault_servers) -> None:
    engine = SGLangEngine(fault_servers["rooted"].url)
    for _ in range(10):
        await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))
        load = await engine.load()
        assert (load.running, load.waiting) == (0, 0), load
    await engine.aclose()


# ---- the engine core in this process: a fault injected into prefill ----


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    core, _info = build_core(EngineOptions(model=str(tiny_model_dir)), model, tokenizer)
    worker = threading.Thread(target=core.run, daemon=True)
    worker.start()
    yield core
    core.stop()
    worker.join(timeout=10)


def _submit(core: EngineCore, prompt: list[int], max_new: int, seen: list) -> threading.Event:
    done = threading.Event()

    def notify(seq: Sequence) -> None:
        seen.append((seq, core.load()))
        done.set()

    spec = SamplingSpec(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    seq = Sequence(rid=str(prompt), prompt_ids=prompt, spec=spec, max_new=max_new, notify=notify)
    assert core.submit([seq])
    return done


@pytest.mark.parametrize("where", ["prefill", "slot_table"])
def test_a_failing_admission_fails_only_the_new_rows(core, monkeypatch, where) -> None:
    """A fault while admitting [9, 9, 9] (in its prefill, or after its rows took cache slots)
    answers it with an error; the row already running goes on to the same output as alone."""
    alone: list = []
    assert _submit(core, [5, 6, 7], 300, alone).wait(60)
    target, name = (kvops, "prefill") if where == "prefill" else (SlotTable, "admit")
    real = getattr(target, name)

    def faulty(*args):  # prefill(model, prompts, pad) or SlotTable.admit(self, specs, ...)
        if [9, 9, 9] in args[1] or any(getattr(s, "max_new_tokens", 0) == 5 for s in args[1]):
            raise RuntimeError("injected fault")
        return real(*args)

    monkeypatch.setattr(target, name, faulty)
    seen: list = []
    long_done = _submit(core, [5, 6, 7], 300, seen)
    while core.load()[0] == 0:
        time.sleep(0.001)
    bad_done = _submit(core, [9, 9, 9], 5, seen)
    assert bad_done.wait(30) and long_done.wait(60)
    finished = {tuple(seq.prompt_ids): seq for seq, _ in seen}
    assert finished[(9, 9, 9)].stop.reason is FinishReason.ERROR
    survivor = finished[(5, 6, 7)]
    assert survivor.stop.reason is FinishReason.LENGTH
    assert survivor.output_ids == alone[0][0].output_ids


def test_a_row_is_out_of_the_batch_when_its_owner_hears_of_it(core) -> None:
    seen: list = []
    assert _submit(core, [1, 2, 3], 4, seen).wait(30)
    ((seq, (running, waiting)),) = seen
    assert seq.stop.reason is FinishReason.LENGTH and (running, waiting) == (0, 0)


async def test_vllm_aborts_match_exact_external_ids(fault_servers) -> None:
    """As vLLM: /abort_requests takes the external id of a completion, `cmpl-<request_id>-<i>`;
    the bare request_id aborts nothing (the real vLLM answers 200 and lets it run: the client
    must send the external id, `VLLMEngine.abort`)."""
    url = fault_servers["rooted"].url
    engine = VLLMEngine(url)
    long = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
    box: list = []

    async def run(rid: str) -> None:
        box.append((rid, await engine.generate([5, 6], long, rid=rid)))

    async with httpx.AsyncClient(base_url=url) as http, trio.open_nursery() as nursery:
        nursery.start_soon(run, "grp-1-0")
        nursery.start_soon(run, "grp-2-0")
        await _until(lambda: _running_is(http, 2))
        bare = await http.post("/abort_requests", json={"request_ids": ["grp-1-0", "cmpl-grp-1"]})
        assert bare.json()["aborted"] == 0
        await engine.abort("grp-1")
        await _until(lambda: _running_is(http, 1))
        await http.post("/abort_requests", json={"request_ids": [completion_request_id("grp-2-0")]})
    await engine.aclose()
    finished = dict(box)
    assert finished["grp-1-0"].finish_reason == FinishReason.ABORT
    assert finished["grp-2-0"].finish_reason == FinishReason.ABORT
    assert 0 < len(finished["grp-1-0"].output_ids) < 500
