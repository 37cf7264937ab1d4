"""Weight sync from disk: every engine reloads the weight files (`files.py`), all at once, and
proves it.

`sync_weights_to_engines` runs one task per engine in a trio nursery: pause -> reload from disk
-> resume (also when the reload fails) -> read back the weight version -> the content check
(with a probe). A failing engine is retried a bounded number of times and reported with its
error; the time of each phase is kept. `DiskDelivery` is what a run hands its pool's `sync`
(`EnginePool.sync`: it waits, locks, marks the failing engines down and records the weights):
full HF weights, or with `adapter` a LoRA adapter loaded by name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import trio

from rollouts import tracing
from rollouts.inference.protocol import AdapterLoader, InferenceEngine
from rollouts.inference.sync import (
    Delivered,
    EngineSyncResult,
    SyncOptions,
    SyncReport,
    Weights,
    WeightSyncError,
)
from rollouts.weights.check import WeightProbe, check_engine

RESUME_TIMEOUT_S = 30.0


class _Clock:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        return elapsed


def load_from_disk(engine: InferenceEngine, path: str, version: str, adapter: bool) -> Any:
    """The engine's load of `path` as `version`: a LoRA adapter directory (`AdapterLoader`),
    or a full HF model directory."""
    if not adapter:
        return engine.update_weights_from_disk(path, version)
    if not isinstance(engine, AdapterLoader):
        raise TypeError(
            f"{engine.url}: this engine client loads no LoRA adapters; set "
            "weight_sync.lora = 'merged' to send it merged full weights"
        )
    return engine.load_adapter(path, version)


async def _attempt(
    engine: InferenceEngine,
    path: str,
    version: str,
    options: SyncOptions,
    probe: WeightProbe | None,
    adapter: bool,
) -> dict[str, float]:
    """One pause -> load -> resume -> verify (the version label, then the content when there
    is a probe); resume runs even when the pause or load fails."""
    clock = _Clock()
    times: dict[str, float] = {}
    lane = tracing.engine_lane(engine.url)
    with trio.fail_after(options.timeout_s):
        try:
            await engine.pause(options.pause)
            times["pause_s"] = tracing.phase("pause", clock.lap(), lane)
            await load_from_disk(engine, path, version, adapter)
            times["load_s"] = tracing.phase("weight load", clock.lap(), lane, version=version)
        finally:
            with trio.CancelScope(shield=True), trio.fail_after(RESUME_TIMEOUT_S):
                await engine.resume()
            times["resume_s"] = tracing.phase("resume", clock.lap(), lane)
        served = await engine.weight_version()
        times["verify_s"] = tracing.phase("version check", clock.lap(), lane)
        if served != version:
            raise RuntimeError(
                f"engine serves weight_version {served!r} after the reload, not {version!r}"
            )
        if probe is not None:
            times["content_gap"] = await check_engine(engine, probe)
            times["check_s"] = tracing.phase("content check", clock.lap(), lane)
    return times


async def sync_engine(
    engine: InferenceEngine,
    path: str,
    version: str,
    *,
    options: SyncOptions = SyncOptions(),
    probe: WeightProbe | None = None,
    adapter: bool = False,
) -> EngineSyncResult:
    """Sync one engine, retrying up to `options.attempts` times; never raises for an engine
    failure. With a `probe`, an engine that does not serve the trainer's weights has failed
    too. `adapter`: `path` is a LoRA adapter directory (`AdapterLoader.load_adapter`)."""
    start = time.perf_counter()
    error = "no attempt made"
    for attempt in range(1, options.attempts + 1):
        try:
            times = await _attempt(engine, path, version, options, probe, adapter)
        except Exception as exc:  # an engine failure: reported, retried, never lost
            error = f"{type(exc).__name__}: {exc}"
            if attempt < options.attempts:
                await trio.sleep(options.retry_delay_s * attempt)
            continue
        total = time.perf_counter() - start
        return EngineSyncResult(url=engine.url, ok=True, attempts=attempt, total_s=total, **times)
    total = time.perf_counter() - start
    return EngineSyncResult(
        url=engine.url, ok=False, attempts=options.attempts, error=error, total_s=total
    )


async def sync_weights_to_engines(
    engines: Sequence[InferenceEngine],
    checkpoint_path: str | Path,
    version: str,
    *,
    options: SyncOptions = SyncOptions(),
    strict: bool = True,
    probe: WeightProbe | None = None,
    adapter: bool = False,
) -> SyncReport:
    """Reload `checkpoint_path` (an HF model dir; with `adapter`, a LoRA adapter dir) on every
    engine at once as `version`.

    Raises WeightSyncError (holding the report) if any engine still fails after its retries and
    `strict`; otherwise the report lists the failures.
    """
    assert engines, "no engines to sync"
    path = str(checkpoint_path)
    marker = "adapter_config.json" if adapter else "config.json"
    if not (Path(path) / marker).is_file():
        kind = "a LoRA adapter" if adapter else "an HF model"
        raise FileNotFoundError(f"{path}: no {marker}; weight sync needs {kind} directory")
    start = time.perf_counter()
    results: list[EngineSyncResult | None] = [None] * len(engines)

    async def one(i: int) -> None:
        results[i] = await sync_engine(
            engines[i], path, version, options=options, probe=probe, adapter=adapter
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(engines)):
            nursery.start_soon(one, i)
    done = tuple(r for r in results if r is not None)
    assert len(done) == len(engines), f"{len(done)=} != {len(engines)=}"
    failed = sum(not r.ok for r in done)
    total_s = time.perf_counter() - start
    report = SyncReport(
        version=version, path=path, results=done, total_s=total_s, engines_down=failed
    )
    if strict and not report.ok:
        raise WeightSyncError(report)
    return report


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DiskDelivery:
    """Every engine given reloads `path` (an HF model directory; with `adapter`, a LoRA adapter
    directory) as `version`: a `Delivery` for `EnginePool.sync`. With a `probe`, an engine that
    does not serve the trainer's weights has failed too."""

    collective: ClassVar[bool] = False  # engine by engine: each one takes it or fails alone

    path: str
    version: str
    options: SyncOptions = dataclasses.field(default_factory=SyncOptions)
    probe: WeightProbe | None = None
    adapter: bool = False

    @property
    def weights(self) -> Weights:
        """The files' weights: an engine that comes back reloads them from `path`."""
        return Weights(version=self.version, path=self.path, adapter=self.adapter)

    async def deliver(self, engines: Sequence[InferenceEngine]) -> Delivered:
        """Reload on `engines`; the ones that still fail after their retries, with why."""
        report = await sync_weights_to_engines(
            engines,
            self.path,
            self.version,
            options=self.options,
            strict=False,
            probe=self.probe,
            adapter=self.adapter,
        )
        failed = {j: r.error or "failed" for j, r in enumerate(report.results) if not r.ok}
        return Delivered(report=report, failed=failed)
