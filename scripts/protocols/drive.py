"""Drive the project's engine clients through a whole sync cycle against a real server's app.

    python scripts/protocols/drive.py sglang|vllm MODEL_DIR

Starts the server's own ASGI app (SGLang's or vLLM's, a stub model behind it; see
sglang_app.py / vllm_app.py) with uvicorn on 127.0.0.1 in a thread, then runs the client:
readiness wait, generate, a batch generate (a group in one request; SGLang) with an abort by rid
prefix inside it, an async-mode sync (pause keep -> reload -> resume) with a request
running through it, abort- and wait-mode syncs, the served version, abort_all, load, and
a colocated sleep (sleep with a request running, wake-up, reload), and
(SGLang) LoRA adapter syncs: load by name, requests naming it in `lora_path`, stale ones
unloaded. Any body the server refuses raises (EngineRequestError with its message); any field
the client needs and does not find fails an assert or the client's own parsing. Prints one line
per step and exits 0 when all pass. Run inside `.venv-protocols` (scripts/test_protocols.sh).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any

import trio

from rollouts.inference.readiness import wait_until_ready
from rollouts.wire.generation import FinishReason, GenerateRequest, SamplingParams

SHORT = SamplingParams(max_new_tokens=4, temperature=0.0)
LONG = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)


def serve_in_thread(app: Any) -> str:
    """uvicorn on a free loopback port in a daemon thread (no lifespan: the stub is set up)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 60 s"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


def step(name: str) -> None:
    print(f"  ok  {name}", flush=True)


async def until_running(probe: Any, count: int = 1) -> None:
    """Until `count` requests run (SGLang: /v1/loads; vLLM: the client's own count), plus a few
    steps."""
    with trio.fail_after(30):
        while (await probe.load()).running < count:
            await trio.sleep(0.01)
    await trio.sleep(0.3)


async def sync_with_a_running_request(
    engine: Any, probe: Any, mode: str, model_dir: str, version: str
) -> Any:
    """pause(mode) -> reload -> resume while a long request runs; its Completion."""
    box: list[Any] = []

    async def run() -> None:
        box.append(await engine.generate([5, 6, 7], LONG, rid=f"long-{mode}"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await until_running(probe)
        await engine.pause(mode)
        assert await engine.health(), "not alive while paused"
        await engine.update_weights_from_disk(model_dir, version)
        await engine.resume()
    return box[0]


async def batch_requests(engine: Any, probe: Any) -> None:
    """A group as one batch /generate (what the rollout manager sends): one answer per prompt,
    each with its own length; an abort by rid prefix cuts only the prompts it names."""
    short = [
        GenerateRequest(input_ids=(5, 6), sampling=SHORT, rid="grp-s0"),
        GenerateRequest(input_ids=(5, 6, 7), sampling=LONG, rid="grp-s1"),
    ]
    got = await engine.generate_many(short)
    assert [c.completion_tokens for c in got] == [4, 60], got
    assert all(len(c.logprobs) == c.completion_tokens for c in got), got
    step("batch generate: one answer per prompt, in order, each with its logprobs")
    batch = [
        GenerateRequest(input_ids=(5,), sampling=LONG, rid="cut-s0"),
        GenerateRequest(input_ids=(6,), sampling=LONG, rid="cut-s1"),
        GenerateRequest(input_ids=(7,), sampling=LONG, rid="keep-s0"),
    ]
    box: list[Any] = []

    async def run() -> None:
        box.extend(await engine.generate_many(batch))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await until_running(probe, count=3)
        await engine.abort("cut-")
    assert [c.finish_reason for c in box] == [
        FinishReason.ABORT,
        FinishReason.ABORT,
        FinishReason.LENGTH,
    ], box
    step("abort by rid prefix inside a batch: the two named prompts ABORT, the third finishes")


async def adapter_syncs(engine: Any, stub: Any, model_dir: str) -> None:
    """SGLang's LoRA routes: three adapter syncs (pause, load by name, version, resume); each
    request names the served adapter; the oldest is unloaded (two stay)."""
    for version in ("4", "5", "6"):
        await engine.pause("keep")
        await engine.load_adapter(model_dir, version)
        await engine.resume()
        done = await engine.generate([5, 6], SHORT)
        assert done.weight_version == version, done.weight_version
        assert stub.lora_paths[-1] == f"policy-v{version}", stub.lora_paths[-1]
    got = await engine.generate_many(
        [GenerateRequest(input_ids=(5, 6), sampling=SHORT, rid=f"lora-{i}") for i in range(2)]
    )
    assert len(got) == 2 and stub.lora_paths[-2:] == ["policy-v6", "policy-v6"], stub.lora_paths
    assert sorted(stub.adapters) == ["policy-v5", "policy-v6"], stub.adapters
    step("LoRA: adapters loaded by name, requests name the newest, the oldest unloaded")


async def sleep_cycle(engine: Any, probe: Any, url: str, model_dir: str, stub: Any) -> None:
    """The colocated step (`engines.sleep_level`): sleep with a request running (it is
    aborted), wake up, reload, generate."""
    import httpx

    box: list[Any] = []

    async def run() -> None:
        box.append(await engine.generate([9], LONG))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await until_running(probe)
        await engine.sleep(2)
    assert box[0].finish_reason is FinishReason.ABORT, box[0]
    if stub is None:  # vLLM: GET /is_sleeping
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
    else:
        assert stub.released == {"weights", "kv_cache", "cuda_graph"}, stub.released
    assert await engine.health()  # alive while asleep (SGLang's client asks /model_info)
    await engine.wake_up()
    await engine.update_weights_from_disk(model_dir, "10")
    done = await engine.generate([5, 6], SHORT)
    assert done.weight_version == "10" and done.completion_tokens == 4, done
    step("sleep (level 2) aborts the running request; wake-up, reload, generate on version '10'")


async def cycle(client: Any, url: str, model_dir: str, stub: Any = None) -> None:
    """The whole cycle through one client; raises at the first refusal or missing field."""
    engine = client(url)
    # SGLang's load comes from /v1/loads (any client sees it); vLLM's is the client's own count
    probe = engine if client.__name__ == "VLLMEngine" else client(url)
    await wait_until_ready([engine], 60, report=print, poll_s=0.2)
    step("readiness: /health, then the server named")
    done = await engine.generate([5, 6], SHORT, rid="first")
    assert done.completion_tokens == 4 and len(done.logprobs) == 4, done
    assert done.weight_version == "default", done.weight_version
    step(f"generate: 4 tokens, logprobs, version {done.weight_version!r}")
    if getattr(engine, "batch_generate", False):
        await batch_requests(engine, probe)
    kept = await sync_with_a_running_request(engine, probe, "keep", model_dir, "1")
    assert kept.finish_reason is FinishReason.LENGTH, kept
    assert kept.completion_tokens == 60, kept.completion_tokens
    assert kept.weight_version == "default", kept.weight_version
    assert await engine.weight_version() == "1"
    step("keep-mode sync with a request running: it finishes; its version is the older one")
    aborted = await sync_with_a_running_request(engine, probe, "abort", model_dir, "2")
    assert aborted.finish_reason is FinishReason.ABORT, aborted
    assert await engine.weight_version() == "2"
    step(f"abort-mode sync: the running request aborted after {aborted.completion_tokens} tokens")
    await engine.pause("wait")
    await engine.update_weights_from_disk(model_dir, "3")
    await engine.resume()
    assert await engine.weight_version() == "3"
    step("wait-mode sync")
    box: list[Any] = []

    async def run() -> None:
        box.append(await engine.generate([9], LONG))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await until_running(probe)
        await engine.abort_all()
    assert box[0].finish_reason is FinishReason.ABORT, box[0]
    step("abort_all: the running request returns ABORT")
    done = await engine.generate([5, 6], SHORT)
    assert done.weight_version == "3", done.weight_version
    load = await engine.load()
    assert load.total == 0, load
    step("generate after the cycle serves version '3'; load is 0")
    await sleep_cycle(engine, probe, url, model_dir, stub)
    if stub is not None:
        await adapter_syncs(engine, stub, model_dir)
    await engine.aclose()
    if probe is not engine:
        await probe.aclose()


def main() -> int:
    kind, model_dir = sys.argv[1], sys.argv[2]
    if kind == "sglang":
        from protocols import sglang_app as server

        from rollouts.inference.sglang import SGLangEngine as client
    else:
        from protocols import vllm_app as server

        from rollouts.inference.vllm import VLLMEngine as client
    app, _stub = server.build_app(model_dir)
    url = serve_in_thread(app)
    print(f"{kind} {server.version()}: its own app on {url}, {client.__name__}", flush=True)
    trio.run(cycle, client, url, model_dir, _stub if kind == "sglang" else None)
    print(f"PASS {kind} {server.version()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
