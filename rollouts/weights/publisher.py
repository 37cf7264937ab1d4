"""How the trainer's weights reach the engines: one `WeightPublisher`, chosen once at start.

    open_publisher(config, ...) ->
        DiskPublisher          write weights-only HF files (in /dev/shm), every engine reloads
                               them by path, now                          (rollout.mode = "sync")
        DistributedPublisher   broadcast over a process group the trainer forms with the
                               engines (weight_sync.method = "distributed")
        AdapterPublisher       LoRA: only the adapter (a few MB) is written, and every engine
                               loads it under the version's name (model.lora, weight_sync.lora
                               = "adapter"); with "merged", the disk publisher sends the
                               merged full weights
        OverlappedPublisher    async mode, around the disk or the adapter publisher: the
                               engines load a step's weights while the next step trains; a step
                               that must be served now waits

The loop calls `publish(version, urgent=...)` when a sync is due, `settle()` before it evaluates,
and `idle()` before it generates (no batch starts while a delivery is in flight). Every delivery
is proven by content when `weight_sync.check` is on (`check.py`): each engine's logprobs of a
probe sequence must equal the trainer's, and an engine that differs is marked down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import trio

from rollouts import tracing
from rollouts.config import Config
from rollouts.inference.pool import EnginePool
from rollouts.inference.sync import SyncOptions
from rollouts.tracing import SYNC_LANE
from rollouts.trainer.protocol import LoraAdapters, TrainingBackend
from rollouts.weights.check import (
    WeightProbe,
    check_engines_at_start,
    content_probe,
    probe_metrics,
)
from rollouts.weights.copies import clean_sync_root
from rollouts.weights.disk import DiskDelivery
from rollouts.weights.distributed import DistributedWeightSync
from rollouts.weights.distributed_pool import DistributedDelivery, distributed_sync_for
from rollouts.weights.files import publish_adapter, publish_weights, weight_bytes

Metrics = dict[str, float]
Delivery = Callable[[], Awaitable[Metrics]]  # the engines load weights already published
ProbeOf = Callable[[str], Awaitable[WeightProbe]]


def as_sync_metrics(metrics: Mapping[str, float]) -> Metrics:
    """A sync report's figures under `sync/` (keys that carry a prefix keep it)."""
    return {f"sync/{k}" if "/" not in k else k: float(v) for k, v in metrics.items()}


async def _write(write: Callable[..., Any], *args: Any) -> tuple[Any, Metrics]:
    """`write(*args)` on a worker thread; its result and `{"write_s": seconds}`."""
    started = time.monotonic()
    result = await trio.to_thread.run_sync(write, *args)
    return result, {"write_s": tracing.phase("write", time.monotonic() - started, SYNC_LANE)}


class WeightPublisher(Protocol):
    """Makes the engines serve the trainer's weights (see the module docstring)."""

    async def check_start(self, version: str) -> None:
        """Fail unless every live engine serves the trainer's weights now (before any step)."""
        ...

    async def publish(self, version: str, *, urgent: bool) -> Metrics:
        """Give the engines `version`; `urgent`: they must serve it when this returns. Returns
        the `sync/*` figures known now (an overlapped publisher: the last finished delivery's)."""
        ...

    async def settle(self) -> Metrics:
        """Wait for a delivery in flight; its `sync/*` figures ({} when none), its error raised."""
        ...

    async def idle(self) -> None:
        """Until no delivery is in flight (its error, if any, is left for `settle`)."""
        ...


def sync_options(config: Config) -> SyncOptions:
    """How each engine is synced: `weight_sync.attempts` tries; a load pauses the engines as
    `weight_sync.in_flight` says in async mode, and aborts in sync mode (nothing runs then)."""
    ws = config.weight_sync
    pause = ws.in_flight if config.rollout.mode == "async" else "abort"
    return SyncOptions(attempts=ws.attempts, pause=pause)


@dataclasses.dataclass(kw_only=True)
class _Publisher:
    """What every publisher has: the engines, the trainer, the content check, the options."""

    pool: EnginePool
    backend: TrainingBackend
    probe_of: ProbeOf | None  # None: weight_sync.check is off
    options: SyncOptions  # `sync_options(config)`

    async def probe(self, version: str) -> WeightProbe | None:
        return await self.probe_of(version) if self.probe_of is not None else None

    async def check_start(self, version: str) -> None:
        if self.probe_of is None:
            return
        await check_engines_at_start(self.pool.live_engines(), await self.probe_of(version))

    async def load(
        self, path: Path, version: str, probe: WeightProbe | None, *, adapter: bool
    ) -> Metrics:
        """The pool's engines load the files at `path` (`DiskDelivery`); the sync's figures."""
        delivery = DiskDelivery(
            path=str(path), version=version, options=self.options, probe=probe, adapter=adapter
        )
        report = await self.pool.sync(delivery)
        return report.metrics() | probe_metrics(probe)

    async def settle(self) -> Metrics:
        return {}

    async def idle(self) -> None:
        return None


@dataclasses.dataclass(kw_only=True)
class DiskPublisher(_Publisher):
    """Weights-only files under `root/v_<version>`; every engine reloads them by path."""

    root: Path

    async def publish(self, version: str, *, urgent: bool) -> Metrics:
        probe = await self.probe(version)
        path, written = await _write(publish_weights, self.backend, self.root, version)
        return as_sync_metrics(await self.deliver(path, version, probe) | written)

    async def fix(self, version: str) -> Delivery:
        """Fix `version`'s weights now; the delivery that writes (if still needed) and loads
        them. A backend with snapshots (`TrainingBackend.weight_snapshots`) copies the weights
        and another thread writes the files; others write them now."""
        snapshots = self.backend.weight_snapshots()
        if snapshots is None:
            probe = await self.probe(version)
            path = await trio.to_thread.run_sync(publish_weights, self.backend, self.root, version)
            return functools.partial(self.deliver, path, version, probe)
        weights = await trio.to_thread.run_sync(snapshots.snapshot_weights)
        probe = await self.probe(version)  # of the snapshot: no step ran since

        async def write_and_deliver() -> Metrics:
            write = functools.partial(publish_weights, weights=weights)
            path, written = await _write(write, self.backend, self.root, version)
            return await self.deliver(path, version, probe) | written

        return write_and_deliver

    async def deliver(self, path: Path, version: str, probe: WeightProbe | None) -> Metrics:
        metrics = await self.load(path, version, probe, adapter=False)
        return metrics | {"bytes": float(weight_bytes(path))}


@dataclasses.dataclass(kw_only=True)
class AdapterPublisher(_Publisher):
    """LoRA: the adapter alone under `root/v_<version>`; every engine loads it by name
    (`AdapterLoader`) on the base model it serves, and its requests name it from then on."""

    root: Path
    adapters: LoraAdapters

    async def check_start(self, version: str) -> None:
        """The engines start on the base model: give them the starting (or resumed) adapter,
        checked like every sync."""
        metrics = await self.publish(version, urgent=True)
        size, took = metrics["sync/bytes"], metrics["sync/total_s"]
        print(
            f"[engines] the engines serve the LoRA adapter of version {version} "
            f"({size / 2**20:.2f} MiB, loaded in {took:.2f}s)",
            flush=True,
        )

    async def publish(self, version: str, *, urgent: bool) -> Metrics:
        return as_sync_metrics(await (await self.fix(version))())

    async def fix(self, version: str) -> Delivery:
        """Write `version`'s adapter now (a few MB); the delivery that loads it."""
        probe = await self.probe(version)
        (path, size), written = await _write(publish_adapter, self.adapters, self.root, version)
        return functools.partial(self.deliver, path, version, probe, size, written)

    async def deliver(
        self, path: Path, version: str, probe: WeightProbe | None, size: int, written: Metrics
    ) -> Metrics:
        metrics = await self.load(path, version, probe, adapter=True)
        return metrics | {"bytes": float(size)} | written


class _Fixes(Protocol):
    """A publisher that can fix a version's weights now and deliver them later."""

    async def check_start(self, version: str) -> None: ...

    async def fix(self, version: str) -> Delivery: ...


@dataclasses.dataclass(kw_only=True)
class OverlappedPublisher:
    """The engines load a version while the next step trains (async mode).

    `publish` fixes the version's weights before it returns (`inner.fix`: the next optimizer
    step must not change them); the delivery it returns (pause, load, resume, verify) runs in
    `nursery`, at most one in flight. A failed one raises from the next `publish` or `settle`,
    in the loop (which first checkpoints the trained step).
    """

    inner: _Fixes  # a DiskPublisher or an AdapterPublisher
    nursery: trio.Nursery
    _done: trio.Event = dataclasses.field(default_factory=trio.Event)
    _result: Metrics | Exception | None = None

    def __post_init__(self) -> None:
        self._done.set()

    async def check_start(self, version: str) -> None:
        await self.inner.check_start(version)

    async def publish(self, version: str, *, urgent: bool) -> Metrics:
        metrics = await self.settle()
        deliver = await self.inner.fix(version)
        if urgent:
            return metrics | as_sync_metrics(await deliver())
        self._start(deliver)
        return metrics

    def _start(self, deliver: Delivery) -> None:
        assert self._done.is_set(), "a delivery is still in flight"
        assert self._result is None, f"an unsettled delivery: {self._result!r}"
        done = self._done = trio.Event()

        async def run() -> None:
            try:
                self._result = await deliver()
            except Exception as error:  # raised by `settle`, in the loop
                self._result = error
            finally:
                done.set()

        self.nursery.start_soon(run)

    async def idle(self) -> None:
        await self._done.wait()

    async def settle(self) -> Metrics:
        await self._done.wait()
        result, self._result = self._result, None
        if isinstance(result, Exception):
            raise result
        return as_sync_metrics(result) if result else {}


@dataclasses.dataclass(kw_only=True)
class DistributedPublisher(_Publisher):
    """Broadcasts the weights over the group the trainer forms with the engines
    (`distributed.py`, `distributed_pool.py`); nothing is written to disk."""

    sender: DistributedWeightSync

    async def publish(self, version: str, *, urgent: bool) -> Metrics:
        probe = await self.probe(version)
        delivery = DistributedDelivery(
            sender=self.sender,
            get_weights=self.backend.get_weights,
            version=version,
            options=self.options,
            step=int(version),
            probe=probe,
        )
        report = await self.pool.sync(delivery)
        return as_sync_metrics(report.metrics() | probe_metrics(probe))


@contextlib.asynccontextmanager
async def open_publisher(
    config: Config,
    backend: TrainingBackend,
    pool: EnginePool,
    tokenizer: Any,
    sync_root: Path,
) -> AsyncIterator[WeightPublisher]:
    """The publisher `config` asks for, for the run's life; on exit the distributed group is
    left and the run's weight copies are removed (`sync_root`: `copies.run_sync_root`)."""
    sender = distributed_sync_for(config)  # None for weight_sync.method = "disk"
    is_async = config.rollout.mode == "async"
    common: dict[str, Any] = {
        "pool": pool,
        "backend": backend,
        "probe_of": content_probe(config, backend, tokenizer),
        "options": sync_options(config),
    }
    disk = {"root": sync_root}
    adapters = backend.lora_adapters() if config.weight_sync.lora == "adapter" else None
    try:
        async with trio.open_nursery() as nursery:
            if adapters is not None:
                adapter = AdapterPublisher(**common, **disk, adapters=adapters)
                yield OverlappedPublisher(inner=adapter, nursery=nursery) if is_async else adapter
            elif sender is not None:
                yield DistributedPublisher(**common, sender=sender)
            elif is_async:
                yield OverlappedPublisher(inner=DiskPublisher(**common, **disk), nursery=nursery)
            else:
                yield DiskPublisher(**common, **disk)
            nursery.cancel_scope.cancel()
    finally:
        if sender is not None:
            with trio.CancelScope(shield=True):
                await sender.close(pool.engines)
        clean_sync_root(sync_root, bool(config.weight_sync.dir))
