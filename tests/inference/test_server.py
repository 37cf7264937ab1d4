"""The built-in server driven by both clients: exact greedy outputs and logprobs, n, stops,
batches, aborts, pauses, bad inputs."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest
import torch
import trio

from rollouts.inference.http import EngineRequestError
from rollouts.inference.protocol import InferenceEngine
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.wire.generation import FinishReason, SamplingParams
from tests.hf_reference import greedy_reference, teacher_forced_logprobs

CLIENTS = [SGLangEngine, VLLMEngine]
TEXTS = ["hello world", "2+2=", "The quick brown fox jumps", "a"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.mark.parametrize("client", CLIENTS)
async def test_greedy_equals_generate_and_logprobs_equal_forward(
    servers, ref_model, tokenizer, client
) -> None:
    engine = client(servers["main"].url)
    assert isinstance(engine, InferenceEngine)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(prompts[i], GREEDY)

    async with trio.open_nursery() as nursery:  # concurrent: they share forward passes
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        c = results[i]
        assert list(c.output_ids) == greedy_reference(ref_model, prompt, 12), TEXTS[i]
        expected = teacher_forced_logprobs(ref_model, prompt, list(c.output_ids))
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        assert c.prompt_tokens == len(prompt) and c.weight_version == "default"
        assert c.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    await engine.aclose()


async def test_batch_and_n_samples(servers, ref_model, tokenizer) -> None:
    prompts = [tokenizer.encode(t) for t in TEXTS[:2]]
    async with httpx.AsyncClient(base_url=servers["main"].url, timeout=60) as http:
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        answer = (await http.post("/generate", json=body)).json()
        assert [a["output_ids"] for a in answer] == [
            greedy_reference(ref_model, p, 6) for p in prompts
        ]
        sp = {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "sampling_seed": 11}
        answer = (await http.post("/generate", json={"text": "hi", "sampling_params": sp})).json()
        assert len(answer) == 3 and all(a["meta_info"]["completion_tokens"] <= 5 for a in answer)
        again = (await http.post("/generate", json={"text": "hi", "sampling_params": sp})).json()
        assert [a["output_ids"] for a in again] == [a["output_ids"] for a in answer]  # seeded
        body = {"prompt": prompts[0], "max_tokens": 4, "n": 2, "return_token_ids": True}
        answer = (await http.post("/v1/completions", json=body)).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(len(c["token_ids"]) <= 4 for c in answer["choices"])
        assert answer["usage"]["prompt_tokens"] == len(prompts[0])


def _printable_stop(tokenizer, output: list[int]) -> int:
    for i in range(1, len(output)):
        ch = tokenizer.decode([output[i]])
        if (
            len(ch) == 1
            and ch.isascii()
            and ch.isprintable()
            and ch not in tokenizer.decode(output[:i])
        ):
            return i
    raise AssertionError(f"no printable stop char in {output}")


@pytest.mark.parametrize("client", CLIENTS)
async def test_stop_token_ids_and_stop_strings(servers, tokenizer, client) -> None:
    engine = client(servers["main"].url)
    prompt = tokenizer.encode(TEXTS[2])
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    full = list((await engine.generate(prompt, long)).output_ids)
    at = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    by_id = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(full[at],))
    c = await engine.generate(prompt, by_id)
    assert list(c.output_ids) == full[: at + 1]
    assert (c.finish_reason, c.matched_stop) == (FinishReason.STOP, full[at])
    at = _printable_stop(tokenizer, full)
    stop = tokenizer.decode([full[at]])
    by_str = SamplingParams(
        max_new_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,), no_stop_trim=False
    )
    c = await engine.generate(prompt, by_str)
    assert list(c.output_ids) == full[: at + 1]
    assert (c.finish_reason, c.matched_stop) == (FinishReason.STOP, stop)
    assert not c.text.endswith(stop)
    await engine.aclose()


BAD = [
    ("/generate", {"text": "x", "sampling_params": {"temprature": 1}}, "temprature"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [5] * 600}, "input_ids"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"input_ids": [1, 2, 99999]}, "input_ids"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "model_path"),
]


async def test_bad_inputs_get_400_naming_the_field(servers) -> None:
    async with httpx.AsyncClient(base_url=servers["main"].url, timeout=30) as http:
        for path, body, field in BAD:
            r = await http.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert field in r.text, (field, r.text)
        r = await http.post("/generate", content=b'{"text": "x",')
        assert r.status_code == 400 and "malformed JSON" in r.text
        assert (await http.get("/health")).status_code == 200
    engine = VLLMEngine(servers["main"].url)
    with pytest.raises(EngineRequestError, match="top_k") as info:
        await engine.generate([1, 2], SamplingParams(top_p=0.5, temperature=0.0, top_k=-5))
    assert info.value.status == 400 and "top_k" in info.value.message
    await engine.aclose()


async def _until(predicate, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.005)


@pytest.mark.parametrize("client", CLIENTS)
async def test_abort_mid_generation_returns_partial_output(servers, client) -> None:
    engine = client(servers["main"].url)
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    box: list = []

    async def run() -> None:
        box.append(await engine.generate([5, 6, 7], sampling))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        probe = SGLangEngine(servers["main"].url)
        await _until(lambda: _running(probe))
        await engine.abort_all()
        await probe.aclose()
    c = box[0]
    assert c.finish_reason is FinishReason.ABORT
    assert 1 <= len(c.output_ids) < 400 and len(c.logprobs) == len(c.output_ids)
    await engine.aclose()


async def _running(probe: SGLangEngine) -> bool:
    return (await probe.load()).running > 0


async def test_pause_modes(servers) -> None:
    url = servers["main"].url
    vllm, sglang = VLLMEngine(url), SGLangEngine(url)
    await vllm.pause("abort")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
    await vllm.resume()
    await sglang.pause("keep")  # new requests wait until resumed
    box: list = []

    async def run() -> None:
        box.append(await sglang.generate([5, 6], SamplingParams(max_new_tokens=3)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await _until(lambda: _waiting(sglang))
        assert not box
        await sglang.resume()
    assert box[0].completion_tokens <= 3 and box[0].finish_reason is not FinishReason.ABORT
    await vllm.aclose()
    await sglang.aclose()


async def _waiting(engine: SGLangEngine) -> bool:
    return (await engine.load()).waiting > 0


def _answer(sock: socket.socket) -> bytes:
    """One HTTP/1.1 answer read off `sock` (headers and a Content-Length body); b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("path", ["/end_weight_update", "/flush_cache", "/continue_generation"])
def test_a_body_that_comes_after_its_headers_keeps_the_connection_alive(servers, path) -> None:
    """Routes that ignore their body still answer only once it arrived, so the keep-alive
    connection serves the next request (the client's pool reuses it). Before, hypercorn closed a
    connection whose answer went out before the body, and the next request on it failed with
    "Server disconnected without sending a response" (a CI failure after a weight sync)."""
    port = int(servers["main"].url.rsplit(":", 1)[1])
    first = second = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 2\r\n\r\n".encode())
        time.sleep(0.3)  # the route could have answered by now; its body is still on the way
        with contextlib.suppress(OSError):  # broken pipe or reset: the server closed
            sock.sendall(b"{}")
            first = _answer(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            second = _answer(sock)
    assert first.startswith(b"HTTP/1.1 "), f"no answer to {path}: {first!r}"
    assert b"connection: close" not in first.lower(), first
    assert second.startswith(b"HTTP/1.1 200"), f"the connection closed after {path}: {second!r}"
