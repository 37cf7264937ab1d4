"""Generation calls in engine client processes (`engines.client_processes`), against real
built-in servers: the same completions as in-process calls, the server's errors by type, a
cancelled call stopped at the engine, a killed worker replaced, and workers that end with the
process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import trio

from rollouts.config import EnginesConfig
from rollouts.config.base import ConfigError
from rollouts.inference.client_procs import client_processes
from rollouts.inference.factory import http_options
from rollouts.inference.http import EngineRequestError, EngineUnavailable, HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.wire.generation import FinishReason, GenerateRequest, SamplingParams
from tests.inference.conftest import API_KEY

IN_WORKERS = HttpOptions(client_processes=2)
GENERATION_ROUTE = {SGLangEngine: "/generate", VLLMEngine: "/v1/completions"}
GENERATION_ROUTES = {SGLangEngine: {"/generate"}, VLLMEngine: {"/v1/completions"}}
LONG = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)


def group(n: int) -> list[GenerateRequest]:
    """n seeded samples of one prompt, as a group request sends them."""
    return [
        GenerateRequest(
            input_ids=(5, 6, 7, 8),
            sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=100 + i),
            rid=f"cp-{i}",
        )
        for i in range(n)
    ]


def worker_pids() -> list[int]:
    procs = client_processes(IN_WORKERS.client_processes)._procs
    return [p.pid for p in procs if p is not None and p.poll() is None]


async def test_workers_answer_as_the_driver_does(servers) -> None:
    here = SGLangEngine(servers["main"].url)
    there = SGLangEngine(servers["main"].url, options=IN_WORKERS)
    assert there.http._workers is not None and here.http._workers is None
    try:
        for _ in range(2):  # both workers, and a kept connection reused
            expected = await here.generate_many(group(4))
            got = await there.generate_many(group(4))
            assert got == expected  # ids, logprobs, finish reasons, texts, versions
            assert {c.finish_reason for c in got} <= {FinishReason.LENGTH, FinishReason.STOP}
    finally:
        await here.aclose()
        await there.aclose()
    assert len(worker_pids()) == 2


@pytest.mark.parametrize("client", [SGLangEngine, VLLMEngine])
async def test_each_kind_decodes_in_the_workers(servers, client) -> None:
    """SGLang's route and vLLM's (the built-in server answers both): the same completion, and
    its decode is one a worker runs (no quiet fallback to the driver's thread)."""
    here, there = client(servers["main"].url), client(servers["main"].url, options=IN_WORKERS)
    calls: list = []
    real = there.http._workers.call

    async def counted(call):
        calls.append(call)
        return await real(call)

    there.http._workers.call = counted
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    try:
        got = await there.generate([5, 6, 7], sampling, rid="cp-one")
        assert got == await here.generate([5, 6, 7], sampling, rid="cp-one-here")
    finally:
        await here.aclose()
        await there.aclose()
    assert len(got.output_ids) == len(got.logprobs) > 0
    assert [c.path for c in calls] == [GENERATION_ROUTE[client]]


async def test_a_refusal_crosses_as_itself(servers) -> None:
    engine = SGLangEngine(servers["keyed"].url, api_key="wrong", options=IN_WORKERS)
    try:
        with pytest.raises(EngineRequestError) as caught:
            await engine.generate_many(group(2))
    finally:
        await engine.aclose()
    assert caught.value.status == 401
    assert servers["keyed"].url in str(caught.value)
    keyed = SGLangEngine(servers["keyed"].url, api_key=API_KEY, options=IN_WORKERS)
    try:
        assert len(await keyed.generate_many(group(2))) == 2
    finally:
        await keyed.aclose()


async def wait_running(engine: SGLangEngine, count: int) -> None:
    with trio.fail_after(30):
        while (await engine.load()).running != count:
            await trio.sleep(0.01)


async def test_a_cancelled_call_stops_at_the_engine(servers) -> None:
    """The generation is frozen (pause in place) when its caller goes: only the worker's close
    of the HTTP request can end it."""
    engine = SGLangEngine(servers["main"].url, options=IN_WORKERS)
    try:
        with trio.move_on_after(60) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.generate, [5, 6, 7], LONG)
                await wait_running(engine, 1)
                await engine.http.call("POST", "/pause_generation", json_body={"mode": "in_place"})
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        await wait_running(engine, 0)  # aborted though the server is paused
        await engine.http.call("POST", "/continue_generation", json_body={})
        again = await engine.generate([5, 6], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len(again.output_ids) == 3
    finally:
        await engine.aclose()
    assert "disconnected; aborting its request" in servers["main"].log_tail(20_000)


async def test_a_killed_worker_fails_its_calls_and_is_replaced(servers) -> None:
    engine = SGLangEngine(servers["main"].url, options=HttpOptions(client_processes=1))
    group_of_one = client_processes(1)
    try:
        await engine.generate([5], SamplingParams(max_new_tokens=2, temperature=0.0))
        (victim,) = [p for p in group_of_one._procs if p is not None]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def doomed() -> None:
                    with pytest.raises(EngineUnavailable, match="client process"):
                        await engine.generate([5, 6, 7], LONG)

                nursery.start_soon(doomed)
                await wait_running(engine, 1)
                os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        await wait_running(engine, 0)
        again = await engine.generate([5, 6], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len(again.output_ids) == 3
        (replacement,) = [p for p in group_of_one._procs if p is not None]
        assert replacement.pid != victim.pid and replacement.poll() is None
    finally:
        await engine.aclose()


CHILD = """
import sys, trio
from rollouts.inference.client_procs import client_processes
from rollouts.inference.http import HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.wire.generation import SamplingParams

async def main():
    engine = SGLangEngine(sys.argv[1], options=HttpOptions(client_processes=1))
    await engine.generate([5], SamplingParams(max_new_tokens=2, temperature=0.0))
    print(client_processes(1)._procs[0].pid, flush=True)

trio.run(main)
import os
os._exit(0)  # no atexit: the worker must see its stdin close
"""


def test_workers_end_with_their_driver(servers) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, servers["main"].url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our child's child: reaped by init, or a zombie of nobody we could wait for
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"engine client process {pid} outlived its driver")


def test_the_config_key_reaches_the_clients() -> None:
    assert http_options(EnginesConfig(client_processes=3)).client_processes == 3
    assert http_options(EnginesConfig()).client_processes == 0
    with pytest.raises(ConfigError, match=r"engines.client_processes = 65: must be 0 \(in"):
        EnginesConfig(client_processes=65)


async def test_a_worker_that_cannot_start_says_so(monkeypatch) -> None:
    from rollouts.inference import client_procs
    from rollouts.inference.client_procs import Call, ClientProcesses

    monkeypatch.setattr(client_procs.sys, "executable", "/bin/false")
    group = ClientProcesses(1)
    call = Call("http://127.0.0.1:9", "", HttpOptions(), "POST", "/generate", {}, len)
    try:
        with pytest.raises(RuntimeError, match=r"exited with code 1.*client_processes = 0"):
            await group.call(call)
    finally:
        group.close()
