"""Bad requests against a real `rollouts serve` process: each one fails alone, with a 4xx that
names its field, before it reaches the engine; the requests running beside it are untouched."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.config.engine_options import EngineOptions
from rollouts.engine.app import build_app, build_core
from rollouts.engine.cli import is_loopback
from rollouts.engine.state import ServerState
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import generate_body
from rollouts.inference.vllm import completion_body
from rollouts.wire.generation import FinishReason, SamplingParams

LONG = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
NAN, INF = float("nan"), float("inf")
# (route, body, the field the 400 must name); sent as Python's json writes it (NaN, Infinity)
BAD_VALUES = [
    ("/generate", {"sampling_params": {"top_k": 2**70}}, "top_k"),
    ("/generate", {"sampling_params": {"temperature": NAN}}, "temperature"),
    ("/generate", {"sampling_params": {"temperature": INF}}, "temperature"),
    ("/generate", {"sampling_params": {"top_p": NAN}}, "top_p"),
    ("/generate", {"sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2**70}}, "max_new_tokens"),
    ("/generate", {"sampling_params": {"stop_token_ids": [2**70]}}, "stop_token_ids"),
    ("/generate", {"top_logprobs_num": 2**70}, "top_logprobs"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"temperature": NAN}, "temperature"),
    ("/v1/completions", {"top_k": -(2**70)}, "top_k"),
    ("/v1/chat/completions", {"top_k": 0}, "top_k"),
]
PROMPT = {
    "/generate": {"input_ids": [1, 2]},
    "/v1/completions": {"prompt": [1, 2]},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
}
BAD_SHAPES = [
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("/generate", {"input_ids": [1, 2], "return_logprobs": True}, "did you mean 'return_logprob'"),
    ("/generate", {"input_ids": [1, 2], "image_data": "x.png"}, "image_data"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temprature": 0}}, "temperature"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 1_000_000}}, "--max-queue"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": {"n": 600}}, "1200 sequences"),
    ("/v1/completions", {"prompt": [1, 2], "n": 10_000}, "--max-queue"),
]


async def _until(predicate, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.005)


async def test_bad_values_get_400_and_spare_the_running_requests(fault_servers) -> None:
    url = fault_servers["rooted"].url
    engine = SGLangEngine(url)
    box: list = []

    async def long_request() -> None:
        box.append(await engine.generate([5, 6, 7], LONG))

    async with httpx.AsyncClient(base_url=url, timeout=60) as http, trio.open_nursery() as n:
        n.start_soon(long_request)
        await _until(lambda: _running(engine))
        for route, bad, field in BAD_VALUES:
            raw = json.dumps(PROMPT[route] | bad)
            r = await http.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (route, raw, r.text)
            assert field in r.json()["error"]["message"], (field, r.text)
        for route, body, words in BAD_SHAPES:
            r = await http.post(route, json=body)
            assert r.status_code == 400, (route, body, r.text)
            assert words in r.json()["error"]["message"], (words, r.text)
    assert box[0].finish_reason is FinishReason.LENGTH and len(box[0].output_ids) == 120
    await engine.aclose()


async def _running(engine: SGLangEngine) -> bool:
    return (await engine.load()).running > 0


async def test_seeds_at_the_ends_of_their_range_work(fault_servers) -> None:
    async with httpx.AsyncClient(base_url=fault_servers["rooted"].url, timeout=60) as http:
        for seed in (2**64 - 1, -(2**63)):
            sp = {"max_new_tokens": 3, "n": 2, "sampling_seed": seed}
            r = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": sp})
            assert r.status_code == 200 and len(r.json()) == 2, r.text


async def test_a_server_keeps_freed_memory_for_its_next_step(fault_servers) -> None:
    """`rollouts serve` has glibc reuse freed pages (`rollouts/heap.py`): under its defaults a
    decode step's temporaries over the vocabulary were fresh pages, faulted every step."""
    async with httpx.AsyncClient(base_url=fault_servers["short"].url, timeout=60) as http:
        info = (await http.get("/server_info")).json()
    linux = sys.platform.startswith("linux") and os.environ.get("ROLLOUTS_MALLOC") != "system"
    assert info["malloc"] == ("keep" if linux else "system"), info


async def test_what_real_clients_send_to_generate_is_accepted(fault_servers) -> None:
    """Our clients' bodies, and SGLang GenerateReqInput fields slime or a router may add."""
    body = generate_body([1, 2, 3], SamplingParams(max_new_tokens=2, seed=3), "rid-x")
    extra = {"return_text_in_logprobs": True, "top_logprobs_num": 2, "stream": False}
    extra |= {"log_metrics": True, "priority": None, "lora_path": None, "image_data": None}
    extra |= {"return_hidden_states": False, "routed_dp_rank": None, "custom_labels": {"a": "b"}}
    async with httpx.AsyncClient(base_url=fault_servers["rooted"].url, timeout=60) as http:
        r = await http.post("/generate", json=body | extra)
        assert r.status_code == 200, r.text
        completion = completion_body([1, 2], SamplingParams(max_new_tokens=2, seed=1), "r", "m")
        r = await http.post("/v1/completions", json=completion | {"n": None, "user": "u"})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


async def test_huge_prompts_and_bodies_are_refused_at_once(fault_servers) -> None:
    big = "x" * 10_000_000  # far more characters than any 512-token context holds
    async with httpx.AsyncClient(base_url=fault_servers["rooted"].url, timeout=60) as http:
        chat = {"messages": [{"role": "user", "content": big}]}
        for route, body in [
            ("/generate", {"text": big}),
            ("/v1/completions", {"prompt": big}),
            ("/v1/chat/completions", chat),
        ]:
            r = await http.post(route, json=body)
            assert r.status_code == 400 and "fits the context" in r.text, r.text[:300]
        r = await http.post("/generate", json={"text": "ab" * 5000})  # tokenised, then too long
        assert r.status_code == 400 and "the context is 512" in r.text, r.text
        for deep in (b"[" * 100_000 + b"]" * 100_000, b"[" * 2**20 + b"]" * 2**20):
            r = await http.post("/generate", content=deep)
            assert r.status_code == 400 and "nested too deeply" in r.text, r.text
        assert (await http.get("/health")).status_code == 200
    async with httpx.AsyncClient(base_url=fault_servers["short"].url, timeout=60) as http:
        r = await http.post("/generate", json={"input_ids": [1] * 600_000})  # 1.2 MB > 1 MB
        assert r.status_code == 413 and "--max-body-mb" in r.text, r.text


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a torn write
    return dst


async def test_corrupt_weights_answer_an_error_and_keep_the_old_weights(
    fault_servers, tiny_model_dir
) -> None:
    url, root = fault_servers["rooted"].url, fault_servers["root"]
    bad = _corrupt_copy(tiny_model_dir, root / "corrupt")
    engine = SGLangEngine(url)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = await engine.generate([3, 4, 5], greedy)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        with trio.fail_after(60):  # it used to hang here
            body = {"model_path": str(bad), "weight_version": "v-bad"}
            r = await http.post("/update_weights_from_disk", json=body)
            assert r.status_code == 400 and r.json()["success"] is False, r.text
            assert "model.safetensors" in r.json()["message"], r.text
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(bad)}}
            r = await http.post("/collective_rpc", json=rpc)
            assert r.status_code == 400 and "model.safetensors" in r.text, r.text
        assert (await http.get("/model_info")).json()["weight_version"] == "default"
    after = await engine.generate([3, 4, 5], greedy)
    assert after.output_ids == before.output_ids and after.weight_version == "default"
    await engine.aclose()


async def test_reloads_only_from_inside_the_weights_root(fault_servers, tiny_model_dir) -> None:
    url, root = fault_servers["rooted"].url, fault_servers["root"]
    good = root / "good"
    shutil.copytree(tiny_model_dir, good, dirs_exist_ok=True)
    (root / "escape").symlink_to(tiny_model_dir)  # a link out of the root does not count
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for outside in (tiny_model_dir, root / "escape", root / ".." / "x"):
            body = {"model_path": str(outside), "weight_version": "evil"}
            r = await http.post("/update_weights_from_disk", json=body)
            assert r.status_code == 403 and "--weights-root" in r.json()["message"], r.text
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}}
        assert (await http.post("/collective_rpc", json=rpc)).status_code == 403
        body = {"model_path": str(good), "weight_version": "default"}
        r = await http.post("/update_weights_from_disk", json=body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text


def test_a_public_address_needs_an_api_key(tiny_model_dir) -> None:
    base = [sys.executable, "-m", "rollouts.engine", "--model", str(tiny_model_dir)]
    for args in (["--host", "0.0.0.0"], ["--weights-root", str(tiny_model_dir / "config.json")]):
        done = subprocess.run(base + args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert ("--api-key" if "--host" in args else "not a directory") in done.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


# ---- the app in this process, its tokenizer made to hang (fault injection) ----


async def test_tokenising_a_prompt_does_not_stop_the_server(tiny_model_dir) -> None:
    """While one text prompt is being tokenised (here: blocked), other requests are answered."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    core, info = build_core(EngineOptions(model=str(tiny_model_dir)), model, tokenizer)
    state = ServerState(core, info, trio.lowlevel.current_trio_token())
    entered, release, released = threading.Event(), threading.Event(), []

    class HangingTokenizer:
        def encode(self, _text: str, add_special_tokens: bool) -> list[int]:
            entered.set()
            released.append(release.wait(10))  # False: nobody was answered while it hung
            return [1] * 1000  # longer than the context: a 400, the worker is never needed

    state.tokenizer = HangingTokenizer()
    transport = httpx.ASGITransport(app=build_app(state))
    answers: list = []
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:

        async def slow_request() -> None:
            answers.append(await http.post("/generate", json={"text": "hello"}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_request)
            await trio.to_thread.run_sync(entered.wait)
            assert (await http.get("/model_info")).status_code == 200
            release.set()
    assert released == [True]
    assert answers[0].status_code == 400 and "1000 tokens" in answers[0].text


async def test_a_client_that_leaves_before_its_body_is_no_server_error(tiny_model_dir, caplog):
    """A caller that gives up mid-request (an abort it timed out under load, say): logged as
    such, not as an unhandled error with a traceback, and the server raises nothing."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    core, info = build_core(EngineOptions(model=str(tiny_model_dir)), model, tokenizer)
    app = build_app(ServerState(core, info, trio.lowlevel.current_trio_token()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/abort_request",
        "raw_path": b"/abort_request",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 30000),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}  # gone before a byte of the body

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)
    assert "unhandled error" not in caplog.text, caplog.text
    assert "/abort_request: the client left before its request was read" in caplog.text
