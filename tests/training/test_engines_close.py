"""Closing the engines while a health check is due (the CI failure of stop 33: a real-vLLM run
ended with "Cannot send a request, as the client has been closed" after its last step, because
`open_engines` closed the clients before it stopped the health checks)."""

from __future__ import annotations

from pathlib import Path

import trio

from rollouts.driver.engines import open_engines
from tests.training.test_engine_failover import _config


async def test_a_health_check_due_while_the_clients_close_sends_nothing(
    tiny_model_dir: Path,
) -> None:
    config = _config(tiny_model_dir, {"num_engines": 1}, health_interval_s=0.01)
    checks_after_close: list[str] = []
    async with open_engines(config, tiny_model_dir, "0") as pool:
        engine = pool.engines[0]
        close, health = engine.aclose, engine.health

        async def slow_close() -> None:  # the injected fault: a close that takes a while
            await close()
            checks_after_close.append("closed")
            await trio.sleep(0.3)  # 30 health intervals with the client already closed

        async def counted_health() -> bool:
            if checks_after_close:
                checks_after_close.append(engine.url)
            return await health()

        engine.aclose, engine.health = slow_close, counted_health  # type: ignore[method-assign]
        await trio.sleep(0.1)  # the checks run
    assert checks_after_close == ["closed"]


async def test_a_check_handed_the_weights_lock_as_the_clients_close_sends_nothing(
    tiny_model_dir: Path,
) -> None:
    """The CI failure of stop 38: a check that had just been handed the weights lock (no
    checkpoint after it, so the pending cancel had not reached it) asked the closed client for
    the served version. Made certain here: the check waits on the lock and gets it at the close."""
    config = _config(tiny_model_dir, {"num_engines": 1}, health_interval_s=0.01)
    async with open_engines(config, tiny_model_dir, "0") as pool:
        await pool.weights_lock.acquire()
        while pool.weights_lock.statistics().tasks_waiting == 0:  # a check waits for it
            await trio.sleep(0.005)
        pool.weights_lock.release()  # handed over with no checkpoint before the close
