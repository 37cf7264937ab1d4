"""A weight reload in place (keep-mode pause) during a request: the built-in server reports
which tokens each version produced, and the clients take the oldest (issue 17: a response
whose first tokens came from the old weights is not staleness 0); the tokens after the reload
come from the new weights over the whole sequence, its KV cache rebuilt (issue 27). A wait
pause instead lets the request finish on the old weights first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from rollouts.engine.launch import EngineProcess, engine_server_sync
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import generate_body
from rollouts.inference.vllm import VLLMEngine, completion_body
from rollouts.wire.generation import SamplingParams

LONG = SamplingParams(max_new_tokens=120, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    with engine_server_sync(tiny_model_dir, max_batch=4) as proc:
        yield proc


async def _reload_in_place_while(server, weights_dir, request) -> tuple[Any, str, str]:
    """Run `request()` and reload the weights (from `weights_dir`) in place while it runs."""
    sync = SGLangEngine(server.url)
    old = await sync.weight_version()
    new = str(int(old) + 1) if old.isdigit() else "1"
    out: dict[str, Any] = {}

    async def run() -> None:
        out["answer"] = await request()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while (await sync.load()).running < 1:  # admitted: its first token exists
                await trio.sleep(0.005)
            await sync.pause("keep")
            await sync.update_weights_from_disk(str(weights_dir), new)
            await sync.resume()
    finally:
        await sync.aclose()
    return out["answer"], old, new


def _check_spans(spans: list[dict[str, Any]], old: str, new: str, total: int) -> None:
    assert [s["version"] for s in spans] == [old, new]
    assert spans[0]["start"] == 0
    assert 1 <= spans[0]["end"] == spans[1]["start"] < total
    assert spans[1]["end"] == total


async def test_sglang_route_reports_version_spans(server, tiny_model_dir) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = generate_body([5, 6, 7], LONG, "span-sglang")
            return (await http.post("/generate", json=body)).json()

        answer, old, new = await _reload_in_place_while(server, tiny_model_dir, request)
    meta = answer["meta_info"]
    assert meta["weight_version"] == new  # SGLang: the version at the end
    _check_spans(meta["weight_versions"], old, new, len(answer["output_ids"]))


async def test_vllm_route_reports_version_spans(server, tiny_model_dir) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = completion_body([5, 6, 7], LONG, "span-vllm", None)
            return (await http.post("/v1/completions", json=body)).json()

        answer, old, new = await _reload_in_place_while(server, tiny_model_dir, request)
    choice = answer["choices"][0]
    _check_spans(choice["weight_versions"], old, new, len(choice["token_ids"]))


@pytest.mark.parametrize("client", [SGLangEngine, VLLMEngine])
async def test_clients_take_the_oldest_version(server, tiny_model_dir, client) -> None:
    """The generating client did not run the sync itself: only the server can tell it."""
    engine = client(server.url)
    try:
        completion, old, new = await _reload_in_place_while(
            server, tiny_model_dir, lambda: engine.generate([5, 6, 7], LONG, rid="span-client")
        )
    finally:
        await engine.aclose()
    assert completion.completion_tokens == LONG.max_new_tokens
    assert completion.weight_version == old != new


@torch.no_grad()
def _logprobs_T_V(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Row t: the log-distribution of output token t given prompt + output[:t], one forward."""
    full = torch.tensor([prompt + output])
    return model(full).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)


def _check_from(
    model: torch.nn.Module, prompt: list[int], ids: list[int], lps: list[float], span: slice
) -> None:
    """The tokens of `span` are `model`'s greedy choices, with `model`'s logprobs (fp32)."""
    logprobs_T_V = _logprobs_T_V(model, prompt, ids)[span]
    want = logprobs_T_V.gather(1, torch.tensor(ids[span])[:, None])[:, 0]
    gap = (want - torch.tensor(lps[span])).abs()
    worst = int(gap.argmax())
    assert float(gap[worst]) < 1e-4, (
        f"logprob of token {span.start + worst} (of {span.start}:{len(ids)}) is off by "
        f"{float(gap[worst]):.4f}: {lps[span][worst]:.4f} served, {float(want[worst]):.4f} expected"
    )
    assert ids[span] == logprobs_T_V.argmax(-1).tolist()


async def test_keep_reload_prefills_running_rows_again_on_the_new_weights(
    server, tiny_model_dir, other_model_dir, ref_model
) -> None:
    """A greedy request whose weights change under a keep pause: its tokens before the reload
    are the old model's, those after it the new model's given every token before them (the
    prompt and the old tokens are prefilled again, as SGLang re-prefills retracted requests),
    each with that model's logprob."""
    prompt, greedy = [5, 6, 7], SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    new_model = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = generate_body(prompt, greedy, "reprefill")
            return (await http.post("/generate", json=body)).json()

        try:
            answer, old, new = await _reload_in_place_while(server, other_model_dir, request)
        finally:  # the other tests here serve the tiny model
            sync = SGLangEngine(server.url)
            await sync.update_weights_from_disk(str(tiny_model_dir), "restored")
            await sync.aclose()
    ids, meta = answer["output_ids"], answer["meta_info"]
    lps = [entry[0] for entry in meta["output_token_logprobs"]]
    _check_spans(meta["weight_versions"], old, new, len(ids))
    cut = meta["weight_versions"][1]["start"]
    _check_from(ref_model, prompt, ids, lps, slice(0, cut))
    _check_from(new_model, prompt, ids, lps, slice(cut, len(ids)))


async def test_wait_pause_lets_a_running_request_finish_on_the_old_weights(
    server, tiny_model_dir, other_model_dir, ref_model
) -> None:
    """weight_sync.in_flight = "wait" (async mode's default): the pause returns only once the
    running request has finished, every token of it the old model's; the reload comes after."""
    prompt, greedy = [5, 6, 7], SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    sync = SGLangEngine(server.url)
    old = await sync.weight_version()
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def request() -> None:
                body = generate_body(prompt, greedy, "wait-pause")
                out["answer"] = (await http.post("/generate", json=body)).json()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                while (await sync.load()).running < 1:
                    await trio.sleep(0.005)
                await sync.pause("wait")
                assert "answer" in out, "the wait pause returned while the request ran"
                await sync.update_weights_from_disk(str(other_model_dir), "waited")
                await sync.resume()
    finally:  # the other tests here serve the tiny model
        await sync.update_weights_from_disk(str(tiny_model_dir), "restored")
        await sync.aclose()
    ids, meta = out["answer"]["output_ids"], out["answer"]["meta_info"]
    assert len(ids) == greedy.max_new_tokens
    assert meta["weight_version"] == old
    assert "weight_versions" not in meta  # as SGLang: spans only when the weights changed
    lps = [entry[0] for entry in meta["output_token_logprobs"]]
    _check_from(ref_model, prompt, ids, lps, slice(0, len(ids)))


async def test_keep_reload_leaves_a_seeded_request_as_it_was(server, tiny_model_dir) -> None:
    """Prefilling the running rows again draws nothing from their generators: a seeded request
    whose (same) weights are reloaded under a keep pause gives the tokens it gives without."""
    seeded = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True, seed=11)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def request() -> Any:
            body = generate_body([5, 6, 7], seeded, None)
            return (await http.post("/generate", json=body)).json()

        plain = await request()
        reloaded, old, new = await _reload_in_place_while(server, tiny_model_dir, request)
    _check_spans(reloaded["meta_info"]["weight_versions"], old, new, len(plain["output_ids"]))
    assert reloaded["output_ids"] == plain["output_ids"]
    served = [
        [entry[0] for entry in a["meta_info"]["output_token_logprobs"]] for a in (plain, reloaded)
    ]
    assert torch.allclose(torch.tensor(served[0]), torch.tensor(served[1]), atol=1e-4)
