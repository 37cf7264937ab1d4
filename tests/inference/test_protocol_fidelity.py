"""The clients speak what the real SGLang/vLLM servers accept, and the built-in server answers
in their shapes (issue 15's findings against SGLang 0.5.23's and vLLM 0.33.0's own apps)."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from rollouts.inference.http import HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.versions import SyncBracket, completion_version
from rollouts.inference.vllm import VLLMEngine, reports_weight_versions
from rollouts.wire.generation import FinishReason, SamplingParams

LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)


async def _until(predicate, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.005)


async def test_built_in_answers_in_the_real_shapes(servers, tiny_model_dir) -> None:
    async with httpx.AsyncClient(base_url=servers["main"].url, timeout=60) as http:
        # SGLang: pause/continue answer {message, status: "ok"}
        for path in ("/pause_generation", "/continue_generation"):
            answer = (await http.post(path, json={})).json()
            assert set(answer) == {"message", "status"} and answer["status"] == "ok", answer
        info = (await http.get("/model_info")).json()
        assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
        for key in ("model_path", "tokenizer_path", "is_generation", "weight_version"):
            assert key in info, key
        # vLLM: logprobs 0 gives one top_logprobs entry per token, the sampled token's
        body = {"prompt": [5, 6], "max_tokens": 3, "temperature": 0, "logprobs": 0}
        choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["top_logprobs"]) == len(lp["tokens"]) == 3
        steps = zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"], strict=True)
        assert all(top == {token: value} for top, token, value in steps)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        chat = await http.post("/v1/chat/completions", json={**body, "return_weight_versions": 1})
        spans = chat.json()["choices"][0]["weight_versions"]
        assert spans == [{"version": "default", "start": 0, "end": spans[0]["end"]}]


async def test_update_weight_version_takes_new_version_only(servers) -> None:
    url = servers["main"].url
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        wrong = await http.post("/update_weight_version", json={"weight_version": "7"})
        assert wrong.status_code == 400 and "new_version" in wrong.text
        not_str = await http.post("/update_weight_version", json={"new_version": 7})
        assert not_str.status_code == 400
        try:
            answer = (await http.post("/update_weight_version", json={"new_version": "7"})).json()
            assert answer["success"] is True and answer["new_version"] == "7"
            assert (await http.get("/weight_info")).json() == {"weight_version": "7"}
        finally:
            await http.post("/update_weight_version", json={"new_version": "default"})


async def test_async_mode_sync_keeps_running_requests(servers, tiny_model_dir) -> None:
    """pause keep -> reload with flush_cache -> resume while a request runs: the request goes
    on (SGLang: a retract pause; an in_place one makes the flush fail, as in SGLang 0.5.22+),
    and its version is the bracket's older end."""
    url = servers["main"].url
    engine, probe = SGLangEngine(url), SGLangEngine(url)
    assert await engine.weight_version() == "default"
    box: list = []

    async def run() -> None:
        box.append(await engine.generate([5, 6, 7], LONG))

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await _until(lambda: _running(probe))
                await http.post("/pause_generation", json={"mode": "in_place"})
                body = {"model_path": str(tiny_model_dir), "weight_version": "x"}
                refused = await http.post("/update_weights_from_disk", json=body)
                assert refused.status_code == 400 and refused.json()["success"] is False
                await http.post("/continue_generation", json={})
                assert await probe.weight_version() == "default"
                await engine.pause("keep")
                assert await engine.health()  # liveness while paused
                await engine.update_weights_from_disk(str(tiny_model_dir), "1")
                await engine.resume()
        finally:
            await http.post("/update_weight_version", json={"new_version": "default"})
    completion = box[0]
    assert completion.finish_reason is FinishReason.LENGTH and completion.completion_tokens == 400
    assert completion.weight_version == "default"  # spanned the sync: the older version
    await engine.aclose()
    await probe.aclose()


async def _running(probe: SGLangEngine) -> bool:
    return (await probe.load()).running > 0


async def test_sglang_health_does_not_generate_while_paused() -> None:
    """SGLang's /health generates one token, which waits while paused (503 after 20 s)."""
    paused = False
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        nonlocal paused
        seen.append(request.url.path)
        if request.url.path == "/pause_generation":
            paused = True
        if request.url.path == "/continue_generation":
            paused = False
        if request.url.path == "/health" and paused:
            return httpx.Response(503)
        return httpx.Response(200, json={"message": "ok", "status": "ok"})

    engine = SGLangEngine("http://e", transport=httpx.MockTransport(server))
    assert await engine.health()
    await engine.pause("keep")
    assert await engine.health()
    await engine.resume()
    assert await engine.health()
    assert seen == [
        "/health",
        "/pause_generation",
        "/model_info",
        "/continue_generation",
        "/health",
    ]
    await engine.aclose()


def test_completion_version_from_spans_report_or_bracket() -> None:
    bracket = SyncBracket()
    before = bracket.at_submit()
    # nothing known, nothing reported by the client: the server's word
    assert completion_version(spans=[], reported="0", submitted=before, bracket=bracket) == "0"
    bracket.served("3")
    calm = bracket.at_submit()
    assert completion_version(spans=[], reported=None, submitted=calm, bracket=bracket) == "3"
    bracket.begin_sync()
    bracket.served("4")
    # a sync began while the request ran: the version before it, whatever the server says
    assert completion_version(spans=[], reported="4", submitted=calm, bracket=bracket) == "3"
    assert completion_version(spans=[], reported=None, submitted=calm, bracket=bracket) == "3"
    # spans from the server win: the oldest
    spans = ["2", "4"]
    assert completion_version(spans=spans, reported="4", submitted=calm, bracket=bracket) == "2"
    after = bracket.at_submit()
    assert completion_version(spans=[], reported=None, submitted=after, bracket=bracket) == "4"


async def test_vllm_without_weight_versions_says_so_once_and_uses_the_bracket(caplog) -> None:
    """vLLM < 0.33 ignores return_weight_versions: the answers carry no weight_versions."""
    state = {"version": "default", "reloads": 0}

    def old_vllm(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": state["version"]})
        if path == "/update_weight_version":
            import json

            state["version"] = json.loads(request.content)["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": state["version"]})
        if path == "/v1/completions":
            choice = {"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": "length"}
            choice["logprobs"] = {"token_logprobs": [-0.5, -0.25]}
            return httpx.Response(200, json={"choices": [choice], "usage": {}})
        return httpx.Response(200, json={})

    engine = VLLMEngine("http://old", transport=httpx.MockTransport(old_vllm))
    with caplog.at_level(logging.WARNING, logger="rollouts.inference.vllm"):
        assert await engine.server_version() == "vllm 0.32.0"  # said at start, before any sample
        assert engine.reports_versions is False
        first = await engine.generate([1], SamplingParams(max_new_tokens=2))
        await engine.update_weights_from_disk("/ckpt", "1")
        second = await engine.generate([1], SamplingParams(max_new_tokens=2))
    assert (first.weight_version, second.weight_version) == ("default", "1")
    warnings = [r for r in caplog.records if "does not report weight versions" in r.message]
    assert len(warnings) == 1 and engine.reports_versions is False
    await engine.aclose()


@pytest.mark.parametrize("client", [SGLangEngine, VLLMEngine])
async def test_a_whole_sync_cycle_through_each_client(servers, tiny_model_dir, client) -> None:
    """pause, reload, version, resume, abort, generate: every body accepted."""
    engine = client(servers["main"].url, options=HttpOptions(timeout_s=60))
    try:
        for mode in ("abort", "wait", "keep"):
            await engine.pause(mode)
            await engine.update_weights_from_disk(str(tiny_model_dir), f"c{mode}")
            await engine.resume()
            assert await engine.weight_version() == f"c{mode}"
        await engine.abort_all()
        done = await engine.generate([5, 6], SamplingParams(max_new_tokens=2, temperature=0))
        assert done.weight_version == "ckeep" and done.completion_tokens == 2
        assert await engine.health()
    finally:
        async with httpx.AsyncClient(base_url=servers["main"].url, timeout=60) as http:
            await http.post("/update_weight_version", json={"new_version": "default"})
        await engine.aclose()


def test_which_vllm_versions_report_weight_versions() -> None:
    assert reports_weight_versions("0.32.0") is False
    assert reports_weight_versions("0.27.1") is False
    assert reports_weight_versions("0.33.0") is True
    assert reports_weight_versions("0.33.1rc1.dev3+g1234") is True
    assert reports_weight_versions("rollouts-builtin") is None
