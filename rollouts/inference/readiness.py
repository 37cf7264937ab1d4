"""Waiting for engine servers the user started: poll /health until each answers 200.

A server loading a 7B model refuses connections, or (SGLang) answers 503 while starting, for
minutes. The driver waits up to `engines.startup_timeout_s` before its first weight sync,
printing which URLs are still loading, then names each server's version once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import trio

from rollouts.inference.http import EngineError, EngineUnavailable
from rollouts.inference.protocol import InferenceEngine

POLL_S = 1.0
REPORT_EVERY_S = 10.0


@runtime_checkable
class DescribesServer(Protocol):
    """A client that can name its server's software and version (SGLang, vLLM)."""

    async def server_version(self) -> str:
        """E.g. "sglang 0.5.23"; also notes what that version does not report."""
        ...


def loading_line(loading: Sequence[str], total: int, elapsed_s: float, timeout_s: float) -> str:
    """The progress line: which URLs are still loading."""
    assert loading, "nothing is loading"
    return (
        f"[engines] waiting for {len(loading)} of {total} server(s) to answer /health "
        f"({elapsed_s:.0f}s of engines.startup_timeout_s = {timeout_s:g}): {', '.join(loading)}"
    )


async def wait_until_ready(
    engines: Sequence[InferenceEngine],
    timeout_s: float,
    *,
    report: Callable[[str], None] = print,
    poll_s: float = POLL_S,
    report_every_s: float = REPORT_EVERY_S,
) -> None:
    """Return once every engine's health check passes; EngineUnavailable after `timeout_s`."""
    assert engines, "no engines to wait for"
    assert timeout_s > 0, f"{timeout_s=}"
    ready = [False] * len(engines)
    start = trio.current_time()
    next_report = start
    while True:
        async with trio.open_nursery() as nursery:
            for i in range(len(engines)):
                if not ready[i]:
                    nursery.start_soon(_check, engines, ready, i)
        elapsed = trio.current_time() - start
        loading = [e.url for e, ok in zip(engines, ready, strict=True) if not ok]
        if not loading:
            break
        if elapsed >= timeout_s:
            raise EngineUnavailable(
                f"engines.startup_timeout_s = {timeout_s:g}: no 200 from GET /health of "
                f"{', '.join(loading)}; check that these servers run (their log says why), "
                "or raise engines.startup_timeout_s if the model is still loading"
            )
        if trio.current_time() >= next_report:
            report(loading_line(loading, len(engines), elapsed, timeout_s))
            next_report += report_every_s
        await trio.sleep(poll_s)
    await _describe(engines, trio.current_time() - start, report)


async def _check(engines: Sequence[InferenceEngine], ready: list[bool], i: int) -> None:
    ready[i] = await engines[i].health()


async def _describe(
    engines: Sequence[InferenceEngine], elapsed_s: float, report: Callable[[str], None]
) -> None:
    for engine in engines:
        what = "server"
        if isinstance(engine, DescribesServer):
            try:
                what = await engine.server_version()
            except EngineError as exc:
                what = f"server (version unknown: {exc})"
        report(f"[engines] {engine.url} ready after {elapsed_s:.0f}s: {what}")
