"""Weight sync over torch.distributed: the trainer (rank 0) broadcasts its weights to the engines.

    connect (once, and again when the set of engines changes or the group broke):
        every engine: POST init (joins the group)  ||  trainer: join as rank 0      (concurrent)
    sync(version):
        full weights (FSDP: gathered on rank 0) -> buckets of `bucket_bytes`
        pause all -> begin all -> per bucket:
            every engine: POST receive(bucket)  ||  trainer: broadcast(bucket)     (concurrent)
        -> finish all -> resume all (always) -> every engine must report `version`

The HTTP request that makes an engine enter its receive is started before the broadcast and runs
beside it (a broadcast started alone would wait for a receiver that is never told to come). Every
wait is bounded by `timeout_s`; a failure names the engine and the step, breaks the group (it is
formed again at the next sync) and raises `WeightSyncError`: no engine is left silently stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import torch
import trio

from rollouts.inference.protocol import InferenceEngine, WeightGroupSpec, WeightReceiver
from rollouts.inference.sync import EngineSyncResult, SyncReport, WeightSyncError
from rollouts.weights.disk import RESUME_TIMEOUT_S
from rollouts.weights.transport import Transport, make_transport
from rollouts.wire.generation import PauseMode
from rollouts.wire.ports import free_port
from rollouts.wire.weight_group import GROUP_BACKENDS, GroupBackend, plan_buckets, state_specs


class SyncTarget(InferenceEngine, WeightReceiver, Protocol):
    """An engine client that generates and receives weights (SGLangEngine, VLLMEngine)."""


class _Failed(RuntimeError):
    """A step of the update failed; the errors dict says where."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistSyncOptions:
    """How the trainer forms the group and sends (the `[weight_sync]` config section)."""

    bucket_bytes: int = 256 * 2**20
    master_address: str = "127.0.0.1"  # an address of the trainer the engines can reach
    master_port: int = 0  # 0 = a free port each time the group forms
    backend: GroupBackend = "gloo"  # resolved from "auto" by the caller
    device: str = "cpu"  # where rank 0's buckets live for the broadcast (cuda for nccl)
    group_name: str = "rollouts_weights"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        assert self.bucket_bytes >= 1, f"{self.bucket_bytes=}"
        assert self.backend in GROUP_BACKENDS, f"{self.backend=} not in {GROUP_BACKENDS}"
        assert self.timeout_s > 0, f"{self.timeout_s=}"


def rank_offsets(sizes: Sequence[int]) -> list[int]:
    """Each engine's first rank: the trainer is rank 0, engines follow in order."""
    assert all(s >= 1 for s in sizes), f"{sizes=}"
    offsets, next_rank = [], 1
    for size in sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets


class DistributedWeightSync:
    """The trainer's side of the distributed weight sync, for a set of `WeightReceiver`s."""

    def __init__(self, options: DistSyncOptions) -> None:
        self.options = options
        self._transport: Transport | None = None
        self._members: tuple[str, ...] = ()
        self.spec: WeightGroupSpec | None = None
        self.culprits: tuple[str, ...] = ()  # engines whose own call failed in the last sync

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def connect(
        self, engines: Sequence[SyncTarget], errors: dict[str, str] | None = None
    ) -> None:
        """Form the group with `engines` (all of one wire); bounded by `timeout_s`. A failing
        engine is recorded in `errors` under its URL (then the call raises)."""
        assert engines, "no engines to connect"
        wires = {e.weight_wire for e in engines}
        if len(wires) != 1:
            raise ValueError(f"engines of different wires in one group: {sorted(wires)}")
        o = self.options
        errors = {} if errors is None else errors
        await self.close(engines)
        with trio.fail_after(o.timeout_s):
            found: dict[str, int] = {}

            async def size_of(engine: SyncTarget) -> None:
                found[engine.url] = await engine.weight_group_size()

            await self._each(engines, errors, size_of)  # a dead engine fails here, not in a join
            sizes = [found[e.url] for e in engines]
            spec = WeightGroupSpec(
                master_address=o.master_address,
                master_port=o.master_port or free_port(o.master_address),
                world_size=1 + sum(sizes),
                group_name=o.group_name,
                backend=o.backend,
            )
            transport = make_transport(wires.pop(), o.device)
            join = functools.partial(transport.join, spec, o.timeout_s)
            offsets = dict(zip((e.url for e in engines), rank_offsets(sizes), strict=True))

            def init(engine: SyncTarget) -> Awaitable[None]:
                return engine.init_weight_group(spec, offsets[engine.url])

            await self._each(engines, errors, init, beside=join)
        self._transport, self.spec = transport, spec
        self._members = tuple(e.url for e in engines)

    async def close(self, engines: Sequence[SyncTarget] = ()) -> None:
        """Leave the group (first, so that a receive stuck in it fails), then tell `engines` to
        leave too (best effort, bounded)."""
        transport, self._transport, self._members = self._transport, None, ()
        if transport is None:
            return
        await _in_thread(transport.close)
        if self.spec is not None:
            name = self.spec.group_name
            with trio.move_on_after(RESUME_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    for engine in engines:
                        nursery.start_soon(_quietly, engine.destroy_weight_group, name)

    async def sync(
        self,
        engines: Sequence[SyncTarget],
        get_weights: Callable[[], Mapping[str, torch.Tensor]],
        version: str,
        *,
        pause: PauseMode = "abort",
        step: int | None = None,
    ) -> SyncReport:
        """Make every engine serve the trainer's weights as `version`, or raise WeightSyncError."""
        assert engines, "no engines to sync"
        start = time.perf_counter()
        errors: dict[str, str] = {}
        times: dict[str, float] = {}
        try:
            if not self.connected or self._members != tuple(e.url for e in engines):
                await self._timed(times, "connect_s", self.connect(engines, errors))
            weights = await _in_thread(get_weights)
            await self._transfer(engines, weights, version, pause, errors, times)
        except _Failed:
            pass  # `errors` names the engines
        except trio.TooSlowError:
            errors.setdefault(
                "*",
                f"no progress within weight_sync.distributed.timeout_s = {self.options.timeout_s}",
            )
        except Exception as exc:  # reported below with every engine: all are stale
            errors.setdefault("*", f"{type(exc).__name__}: {exc}")
        self.culprits = tuple(e.url for e in engines if e.url in errors)
        if errors:
            await self._drop_group(engines)
        report = _report(engines, version, errors, times, self.spec, time.perf_counter() - start)
        if not report.ok:
            raise WeightSyncError(report, step=step)
        return report

    async def _transfer(
        self,
        engines: Sequence[SyncTarget],
        weights: Mapping[str, torch.Tensor],
        version: str,
        pause: PauseMode,
        errors: dict[str, str],
        times: dict[str, float],
    ) -> None:
        assert self._transport is not None, "not connected"
        specs = state_specs(weights)
        buckets = plan_buckets(specs, self.options.bucket_bytes)
        with trio.fail_after(self.options.timeout_s):
            await self._each(engines, errors, lambda e: e.pause(pause))
            try:
                clock = time.perf_counter()
                await self._each(engines, errors, lambda e: e.begin_weight_update())
                for i, bucket in enumerate(buckets):
                    last = i == len(buckets) - 1
                    tensors = [weights[s.name] for s in bucket]
                    send = functools.partial(self._transport.send, tensors)

                    def receive(e: SyncTarget, bucket=bucket, last=last) -> object:
                        return e.receive_weight_bucket(
                            bucket,
                            version=version if last else None,
                            flush_cache=last,  # safe: keep pauses are SGLang's retract
                        )

                    await self._each(engines, errors, receive, beside=send)
                await self._each(engines, errors, lambda e: e.finish_weight_update(version))
                times["load_s"] = time.perf_counter() - clock
            finally:
                with trio.CancelScope(shield=True), trio.fail_after(RESUME_TIMEOUT_S):
                    # every engine, also when another one failed
                    await self._each(engines, errors, lambda e: e.resume(), every=True)
            await self._each(engines, errors, functools.partial(_verify, version=version))
            times["verified"] = 1.0
        times["buckets"] = float(len(buckets))
        times["bytes"] = float(sum(s.nbytes for s in specs))

    async def _each(
        self,
        engines: Sequence[SyncTarget],
        errors: dict[str, str],
        call: Callable[[SyncTarget], Awaitable[object]],
        *,
        beside: Callable[[], None] | None = None,
        every: bool = False,
    ) -> None:
        """`call` on every engine at once (and `beside` in a thread); a failure is recorded
        under the engine's URL, cancels the rest (unless `every`), and raises `_Failed`."""
        async with trio.open_nursery() as nursery:

            async def one(engine: SyncTarget) -> None:
                try:
                    await call(engine)
                except Exception as exc:
                    errors.setdefault(engine.url, f"{type(exc).__name__}: {exc}")
                    if not every:
                        nursery.cancel_scope.cancel()

            async def local() -> None:
                assert beside is not None
                try:
                    await _in_thread(beside)
                except Exception as exc:
                    errors.setdefault("trainer", f"trainer side: {type(exc).__name__}: {exc}")
                    nursery.cancel_scope.cancel()

            for engine in engines:  # the receives are on their way before the broadcast starts
                nursery.start_soon(one, engine)
            if beside is not None:
                nursery.start_soon(local)
        if errors:
            raise _Failed(str(errors))

    async def _drop_group(self, engines: Sequence[SyncTarget]) -> None:
        """After a failure the group's state is unknown: close the engines' update, leave the
        group; the next sync forms it again."""
        with trio.CancelScope(shield=True):
            await self.close(engines)
            with trio.move_on_after(RESUME_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    for engine in engines:
                        nursery.start_soon(_quietly, engine.abort_weight_update)

    @staticmethod
    async def _timed(times: dict[str, float], key: str, work: object) -> None:
        clock = time.perf_counter()
        await work  # type: ignore[misc]
        times[key] = time.perf_counter() - clock


async def _in_thread(fn: Callable[[], object]) -> object:
    """Blocking work (joins, broadcasts) off the event loop; abandoned when cancelled (its
    collective then fails on the group's own timeout)."""
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


async def _quietly(fn: Callable[..., Awaitable[object]], *args: object) -> None:
    with contextlib.suppress(Exception):  # leaving a broken group is best effort
        await fn(*args)


async def _verify(engine: SyncTarget, *, version: str) -> None:
    served = await engine.weight_version()
    if served != version:
        raise RuntimeError(f"serves weight_version {served!r} after the update, not {version!r}")


def _report(
    engines: Sequence[SyncTarget],
    version: str,
    errors: dict[str, str],
    times: dict[str, float],
    spec: WeightGroupSpec | None,
    total_s: float,
) -> SyncReport:
    common = errors.get("trainer") or errors.get("*")
    if common is None and not times.get("verified"):  # a collective: all or none got it
        common = "not updated: the update failed on another engine of the group"
    results = []
    for e in engines:
        error = errors.get(e.url) or common
        results.append(
            EngineSyncResult(
                url=e.url,
                ok=error is None,
                attempts=1,
                error=error,
                load_s=times.get("load_s", 0.0),
                total_s=total_s,
            )
        )
    where = f"{spec.backend}://{spec.master_address}:{spec.master_port}" if spec else "distributed"
    stats = {k: times[k] for k in ("connect_s", "buckets") if k in times}
    if "bytes" in times:
        stats["mib"] = times["bytes"] / 2**20
    return SyncReport(
        version=version, path=where, results=tuple(results), total_s=total_s, stats=stats
    )
