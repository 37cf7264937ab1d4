"""Weight sync: make every engine serve the trainer's new weights, all at once, and prove it.

`sync_weights_to_engines` runs one task per engine in a trio nursery: pause -> reload from disk
-> resume (also when the reload fails) -> read back the weight version. A failing engine is
retried a bounded number of times and reported with its error; the time of each phase is kept.
`sync_pool` is what a run uses: it syncs the pool's engines that are up, marks the ones that fail
down, and records the new weights in the pool, so an engine that comes back later loads them
before it gets a request; it fails only when no engine took the new weights, none being up or
coming back on them within `engines.wait_for_up_s` (an engine restarted mid-sync loads and
proves them through the pool's health check).
`publish_weights` is the fast path to the disk: weights-only HF files (no optimizer) in a fast
local directory (/dev/shm by default), written to a temporary name and renamed, last K kept.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from rollouts.inference.http import EngineUnavailable
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import AdapterLoader, InferenceEngine
from rollouts.trainer.disk_errors import write_error
from rollouts.trainer.protocol import LoraAdapters, TrainingBackend
from rollouts.weights.check import WeightProbe, check_engine

RESUME_TIMEOUT_S = 30.0


class WeightSyncError(RuntimeError):
    """Some engines did not end up serving the new version (the report says which and why)."""

    def __init__(self, report: SyncReport, step: int | None = None) -> None:
        self.report, self.step = report, step
        lines = [f"  {r.url}: {r.error} (after {r.attempts} attempt(s))" for r in report.failed]
        at = f" at step {step}" if step is not None else ""
        super().__init__(
            f"weight sync to version {report.version!r}{at} ({report.path}) failed on "
            f"{len(report.failed)} of "
            f"{len(report.results)} engine(s):\n" + "\n".join(lines)
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineSyncResult:
    """How one engine's sync went: phase times of the last attempt, and its error if it failed."""

    url: str
    ok: bool
    attempts: int
    error: str | None = None
    pause_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    verify_s: float = 0.0
    check_s: float = 0.0
    content_gap: float = 0.0  # |engine - trainer| logprob on the probe (its statistic; the check)
    total_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """All engines' results for one weight version."""

    version: str
    path: str
    results: tuple[EngineSyncResult, ...]
    total_s: float
    engines_down: int = 0  # engines of the pool that were down and not synced (`sync_pool`)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # method-specific numbers

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> tuple[EngineSyncResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for the metrics log: wall time, slowest engine per phase, failures."""
        out = {"total_s": self.total_s, "failed_engines": float(len(self.failed))}
        out["engines_down"] = float(self.engines_down + len(self.failed))
        for phase in ("pause_s", "load_s", "resume_s", "verify_s", "check_s", "content_gap"):
            out[f"{phase}_max"] = max((getattr(r, phase) for r in self.results), default=0.0)
        out["attempts"] = float(sum(r.attempts for r in self.results))
        return out | self.stats


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
    pause_mode: str,
    timeout_s: float,
    probe: WeightProbe | None,
    adapter: bool = False,
) -> dict[str, float]:
    """One pause -> load -> resume -> verify (the version label, then the content when there
    is a probe); resume runs even when the pause or load fails."""
    clock = _Clock()
    times: dict[str, float] = {}
    with trio.fail_after(timeout_s):
        try:
            await engine.pause(pause_mode)
            times["pause_s"] = clock.lap()
            await load_from_disk(engine, path, version, adapter)
            times["load_s"] = clock.lap()
        finally:
            with trio.CancelScope(shield=True), trio.fail_after(RESUME_TIMEOUT_S):
                await engine.resume()
            times["resume_s"] = clock.lap()
        served = await engine.weight_version()
        times["verify_s"] = clock.lap()
        if served != version:
            raise RuntimeError(
                f"engine serves weight_version {served!r} after the reload, not {version!r}"
            )
        if probe is not None:
            times["content_gap"] = await check_engine(engine, probe)
            times["check_s"] = clock.lap()
    return times


async def sync_engine(
    engine: InferenceEngine,
    path: str,
    version: str,
    *,
    attempts: int = 3,
    timeout_s: float = 300.0,
    pause_mode: str = "abort",
    retry_delay_s: float = 0.5,
    probe: WeightProbe | None = None,
    adapter: bool = False,
) -> EngineSyncResult:
    """Sync one engine, retrying up to `attempts` times; never raises for an engine failure.
    With a `probe`, an engine that does not serve the trainer's weights has failed too.
    `adapter`: `path` is a LoRA adapter directory (`AdapterLoader.load_adapter`)."""
    assert attempts >= 1, f"{attempts=}"
    start = time.perf_counter()
    error = "no attempt made"
    for attempt in range(1, attempts + 1):
        try:
            times = await _attempt(engine, path, version, pause_mode, timeout_s, probe, adapter)
        except Exception as exc:  # an engine failure: reported, retried, never lost
            error = f"{type(exc).__name__}: {exc}"
            if attempt < attempts:
                await trio.sleep(retry_delay_s * attempt)
            continue
        total = time.perf_counter() - start
        return EngineSyncResult(url=engine.url, ok=True, attempts=attempt, total_s=total, **times)
    total = time.perf_counter() - start
    return EngineSyncResult(url=engine.url, ok=False, attempts=attempts, error=error, total_s=total)


async def sync_weights_to_engines(
    engines: Sequence[InferenceEngine],
    checkpoint_path: str | Path,
    version: str,
    *,
    attempts: int = 3,
    timeout_s: float = 300.0,
    pause_mode: str = "abort",
    retry_delay_s: float = 0.5,
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
            engines[i],
            path,
            version,
            attempts=attempts,
            timeout_s=timeout_s,
            pause_mode=pause_mode,
            retry_delay_s=retry_delay_s,
            probe=probe,
            adapter=adapter,
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(engines)):
            nursery.start_soon(one, i)
    done = tuple(r for r in results if r is not None)
    assert len(done) == len(engines), f"{len(done)=} != {len(engines)=}"
    report = SyncReport(
        version=version, path=path, results=done, total_s=time.perf_counter() - start
    )
    if strict and not report.ok:
        raise WeightSyncError(report)
    return report


async def sync_pool(
    pool: EnginePool,
    checkpoint_path: str | Path,
    version: str,
    *,
    attempts: int = 3,
    timeout_s: float = 300.0,
    pause_mode: str = "abort",
    retry_delay_s: float = 0.5,
    probe: WeightProbe | None = None,
    adapter: bool = False,
) -> SyncReport:
    """Sync every engine of `pool` that is up (`adapter`: a LoRA adapter directory); the
    failing ones (also those that do not serve the trainer's weights by the `probe`) are
    marked down, not fatal.

    The pool records (path, version) so that engines coming back load these weights first.
    Raises EngineUnavailable when no engine is up within `pool.wait_for_up_s`, and
    WeightSyncError when none of the engines that were up took the new weights and none comes
    back on them within `pool.wait_for_up_s` (an engine killed mid-sync and restarted: the
    health check makes it load and prove them, as it does for a generation's wait).
    """
    if not await pool.wait_for_up():  # outside the lock: health checks bring engines back
        raise EngineUnavailable(
            f"weight sync to version {version!r}: no engine of {pool.url} is up after "
            f"{pool.wait_for_up_s}s; the run stops (resume it with --resume)"
        )
    async with pool.weights_lock:
        live = [i for i, up in enumerate(pool.up) if up]
        if not live:
            raise EngineUnavailable(f"weight sync to version {version!r}: every engine is down")
        report = await sync_weights_to_engines(
            [pool.watched(i) for i in live],  # a hung engine's calls end: it fails, not the sync
            checkpoint_path,
            version,
            attempts=attempts,
            timeout_s=timeout_s,
            pause_mode=pause_mode,
            retry_delay_s=retry_delay_s,
            strict=False,
            probe=probe,
            adapter=adapter,
        )
        for i, result in zip(live, report.results, strict=True):
            if not result.ok:
                pool.mark_down(i)
                print(f"[engines] {result.url} marked down: {result.error}", flush=True)
        pool.set_weights(str(checkpoint_path), version, adapter=adapter)
    if len(report.failed) == len(report.results) and not await pool.wait_for_up():
        raise WeightSyncError(report)
    return dataclasses.replace(report, engines_down=len(pool.engines) - len(live))


def publish_weights(
    backend: TrainingBackend,
    root: str | Path,
    version: str,
    *,
    keep_last: int = 2,
    weights: Any = None,
) -> Path:
    """Write weights-only HF files to `root/v_<version>` (atomically), prune older versions.

    Every rank calls it (FSDP gathers on rank 0). Blocking: run it with trio.to_thread.run_sync.
    `weights`, a `snapshot_weights` copy, are written by the backend's `write_weights` (the
    one-process backend on this thread, the trainer process on its writer thread; the training
    thread is free to go on); without them the backend saves its current weights on its own thread.
    """
    assert keep_last >= 1, f"{keep_last=}"
    root = Path(root)
    final = root / f"v_{version}"
    tmp = root / f".tmp-v_{version}"
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        _recycle(root, tmp, keep_last)
    backend.barrier()
    try:
        snapshots = backend.weight_snapshots()
        if weights is None or snapshots is None:
            assert weights is None, "a snapshot from a backend that takes none"
            backend.save_weights(tmp).result()
        else:
            snapshots.write_weights(weights, tmp)
    except Exception as e:  # a full /dev/shm: name it (weight_sync.dir moves it)
        error = write_error("the weight-sync copy (weight_sync.dir)", tmp, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if error.disk_full or isinstance(e, OSError):
            raise error from e
        raise
    if backend.rank == 0:
        os.utime(tmp)  # files rewritten in place leave a recycled directory's time as it was
        _swap_in(tmp, final, keep_last)
    backend.barrier()
    return final


def _versions(root: Path, but: Path | None = None) -> list[Path]:
    """The `v_*` directories under `root` (not `but`), oldest first."""
    return sorted((p for p in root.glob("v_*") if p != but), key=lambda p: p.stat().st_mtime)


def _recycle(root: Path, tmp: Path, keep_last: int) -> None:
    """Rename the version this publish will prune to `tmp`, so that the files are rewritten in
    place: a tmpfs then reuses its pages instead of allocating (and later freeing) a model's
    worth of new ones each sync (`scripts/bench_weight_write.py`). Only with `keep_last` >= 2:
    the recycled version is then never the newest, the one engines load or restart on (a
    publish starts after the previous delivery ended, `OverlappedPublisher.settle`)."""
    olds = _versions(root)
    if keep_last >= 2 and len(olds) >= keep_last:
        olds[0].rename(tmp)


def _swap_in(tmp: Path, final: Path, keep_last: int) -> None:
    """Rename `tmp` to `final` and keep only the `keep_last` newest `v_*` beside it."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    olds = _versions(final.parent, but=final)
    for old in olds[: max(len(olds) - (keep_last - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def publish_adapter(
    adapters: LoraAdapters, root: str | Path, version: str, *, keep_last: int = 2
) -> tuple[Path, int]:
    """Write the LoRA adapter alone to `root/v_<version>` (atomically, in order after the
    trainer's submitted work), prune older versions; (its directory, its bytes). Blocking."""
    assert keep_last >= 1, f"{keep_last=}"
    root = Path(root)
    final, tmp = root / f"v_{version}", root / f".tmp-v_{version}"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        size = adapters.save_adapter(tmp).result()
    except Exception as e:  # a full /dev/shm: name it (weight_sync.dir moves it)
        error = write_error("the adapter copy (weight_sync.dir)", tmp, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if error.disk_full or isinstance(e, OSError):
            raise error from e
        raise
    _swap_in(tmp, final, keep_last)
    return final, size


def weight_bytes(path: Path) -> int:
    """The bytes of the weight files in `path` (what a disk sync moves)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))
