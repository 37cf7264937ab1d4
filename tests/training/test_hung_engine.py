"""A hung engine (issue 27, item 9), with real processes and a real SIGSTOP: the pool's health
check finds it silent for `engines.stall_timeout_s`, marks it down, and the requests already sent
to it go to the other engine, long before the request timeout; a weight sync goes on without
it; after SIGCONT it comes back, on the pool's weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

from rollouts.driver.engines import open_engines
from rollouts.inference.sync import SyncOptions
from rollouts.weights.disk import DiskDelivery
from rollouts.wire.generation import GenerateRequest, SamplingParams
from tests.training.test_engine_failover import _config, server_pids

STALL_S = 2.0
REQUEST_TIMEOUT_S = 120.0  # what a request sent to the hung engine would otherwise wait


async def test_a_hung_engines_requests_go_to_the_other_engine(tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir, stall_timeout_s=STALL_S, request_timeout_s=REQUEST_TIMEOUT_S)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    group = [
        GenerateRequest(input_ids=(1, 2, 3), sampling=sampling, rid=f"g-{i}") for i in range(4)
    ]
    async with open_engines(config, tiny_model_dir, "0") as pool:
        hung_port = pool.engines[1].url.rsplit(":", 1)[1]
        (hung,) = server_pids(f"--port {hung_port}")
        os.kill(hung, signal.SIGSTOP)
        try:
            pool.states[0].in_flight += 100  # route to the hung engine first
            started = trio.current_time()
            with trio.fail_after(30):  # far below REQUEST_TIMEOUT_S
                async with trio.open_nursery() as nursery:
                    results: list = []

                    async def one() -> None:
                        results.append(await pool.generate([4, 5, 6], sampling, rid="one"))

                    nursery.start_soon(one)
                    many = await pool.generate_many(group)  # a group: one batch request
            elapsed = trio.current_time() - started
            pool.states[0].in_flight -= 100
            assert len(many) == 4 and len(results) == 1
            assert all(c.completion_tokens > 0 for c in [*many, *results])
            assert elapsed >= STALL_S  # they did go to the hung engine first
            assert pool.up == [True, False]
        finally:
            os.kill(hung, signal.SIGCONT)
        await _back(pool)

        os.kill(hung, signal.SIGSTOP)  # hung again, now during a weight sync
        try:
            with trio.fail_after(30):  # its pause would wait REQUEST_TIMEOUT_S
                options = SyncOptions(attempts=2)
                delivery = DiskDelivery(path=str(tiny_model_dir), version="1", options=options)
                report = await pool.sync(delivery)
            assert [r.ok for r in report.results] == [True, False], report
            assert pool.up == [True, False]
            assert await pool.engines[0].weight_version() == "1"
        finally:
            os.kill(hung, signal.SIGCONT)
        await _back(pool)
        assert await pool.engines[1].weight_version() == "1"  # reloaded before it came back
        completion = await pool.engines[1].generate([4, 5], sampling)  # and not left paused
        assert completion.completion_tokens > 0


async def _back(pool) -> None:
    with trio.fail_after(60):  # answering again (on the pool's weights): routed again
        while not all(pool.up):
            await trio.sleep(0.2)
