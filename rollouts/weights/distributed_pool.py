"""The distributed delivery: the trainer's weights broadcast to the engines of a pool's sync
(`EnginePool.sync`, which waits, locks, marks the failing engines down and records the version).

The group is a collective: one engine failing fails the bucket for all. The engines whose own
call failed leave it and the others are synced again at once in a group without them
(bounded: each retry drops at least one engine). There is no file to reload from, so an engine
that comes back is not routed to (the pool records no weights path) until the next sync, which
takes every engine that answers /health into the group and marks it up once it serves the version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch

from rollouts.config import Config
from rollouts.config.weight_sync import SyncBackend
from rollouts.engine_kinds import EngineKind, engine_kind
from rollouts.inference.http import EngineError
from rollouts.inference.protocol import InferenceEngine, WeightReceiver
from rollouts.inference.sync import Delivered, SyncOptions, SyncReport, Weights, WeightSyncError
from rollouts.trainer.factories import resolve_device
from rollouts.weights.check import WeightContentError, WeightProbe, check_engine
from rollouts.weights.distributed import DistributedWeightSync, DistSyncOptions, SyncTarget
from rollouts.weights.reach import LOCAL_MASTER
from rollouts.wire.weight_group import GroupBackend


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistributedDelivery:
    """Broadcast `get_weights()` as `version` to every engine given (a `Delivery` for
    `EnginePool.sync`); with a `probe`, the engines that do not serve them have failed.

    Raises WeightSyncError when no engine took the new weights (or the trainer's side failed),
    WeightContentError when none of those that took them serves them.
    """

    collective: ClassVar[bool] = True  # a process group: down engines that answer join it too

    sender: DistributedWeightSync
    get_weights: Callable[[], Mapping[str, torch.Tensor]]
    version: str
    options: SyncOptions = dataclasses.field(default_factory=SyncOptions)
    step: int | None = None
    probe: WeightProbe | None = None

    @property
    def weights(self) -> Weights:
        """No weights path: a returning engine must not reload old files under the new version."""
        return Weights(version=self.version)

    async def deliver(self, engines: Sequence[InferenceEngine]) -> Delivered:
        """Broadcast to `engines`; the ones that failed (their own call, or the content check)."""
        targets = [_target(e) for e in engines]
        failed: dict[int, str] = {}
        report = await self._broadcast(targets, failed)
        if self.probe is not None:
            report = await _serving(targets, failed, self.probe, report, self.step)
        return Delivered(report=report, failed=failed)

    async def _broadcast(self, engines: Sequence[SyncTarget], failed: dict[int, str]) -> SyncReport:
        """The sync of the engines not in `failed`; each failed try adds the engines whose own
        call failed to `failed` and tries again without them (re-raised when none is left, or
        when no engine is to blame)."""
        while True:
            live = [e for j, e in enumerate(engines) if j not in failed]
            try:
                pause = self.options.pause
                return await self.sender.sync(
                    live, self.get_weights, self.version, pause=pause, step=self.step
                )
            except WeightSyncError as exc:
                errors = {r.url: r.error for r in exc.report.results}
                culprits = self.sender.culprits
                dropped = [
                    j for j, e in enumerate(engines) if j not in failed and e.url in culprits
                ]
                for j in dropped:
                    failed[j] = f"weight sync failed: {errors.get(engines[j].url)}"
                if not dropped or len(failed) == len(engines):
                    raise


def _target(engine: InferenceEngine) -> SyncTarget:
    """`engine` as a receiver of broadcast weights (what the engines of a distributed sync are)."""
    assert isinstance(engine, WeightReceiver), f"{engine.url}: receives no broadcast weights"
    return engine  # type: ignore[return-value]


async def _serving(
    engines: Sequence[SyncTarget],
    failed: dict[int, str],
    probe: WeightProbe,
    report: SyncReport,
    step: int | None,
) -> SyncReport:
    """The content check of the engines not in `failed` (those that fail it are added), and
    the report with the check's figures; WeightContentError when none passes."""
    started = time.perf_counter()
    gaps, errors = [], []
    for j, engine in enumerate(engines):
        if j in failed:
            continue
        try:
            gaps.append(await check_engine(engine, probe, step))
        except (WeightContentError, EngineError) as exc:
            failed[j] = str(exc)
            errors.append(str(exc))
    if not gaps:
        raise WeightContentError("\n".join(errors))
    stats = {"check_s_max": time.perf_counter() - started, "content_gap_max": max(gaps)}
    return dataclasses.replace(report, stats=report.stats | stats)


def distributed_sync_for(config: Config) -> DistributedWeightSync | None:
    """The sync `[weight_sync.distributed]` asks for; None for weight_sync.method = "disk".

    backend "auto": NCCL when the trainer is on CUDA and so are the engines (external SGLang /
    vLLM servers, or built-in engines on a CUDA device), else gloo. NCCL refuses two ranks of a
    group on one GPU, so built-in engines on the trainer's own GPU get gloo.
    """
    ws = config.weight_sync
    if ws.method != "distributed":
        return None
    d = ws.distributed
    device = resolve_device(config.training.device)
    e = config.engines
    kind = engine_kind(e.kind)
    backend = choose_backend(d.backend, device.type == "cuda", kind, e.builtin.device)
    nccl_only = kind.sync_wire.nccl_only
    if nccl_only and (backend != "nccl" or device.type != "cuda"):
        raise ValueError(
            f"weight_sync.method = 'distributed' with engines.kind = {e.kind!r} needs NCCL from "
            f"a trainer on CUDA (weight_sync.distributed.backend = {d.backend!r}, training.device "
            f"= {config.training.device!r}); use weight_sync.method = 'disk' otherwise. "
            f"{nccl_only}"
        )
    options = DistSyncOptions(
        bucket_bytes=max(1, int(d.bucket_mb * 2**20)),
        # "" (automatic) is resolved by the driver at start (weights/reach.py); a caller that
        # builds the sync itself has its engines on this host
        master_address=d.master_address or LOCAL_MASTER,
        master_port=d.master_port,
        backend=backend,
        device=str(device) if backend == "nccl" or nccl_only else "cpu",
        group_name=d.group_name,
        timeout_s=d.timeout_s,
    )
    return DistributedWeightSync(options)


def choose_backend(
    requested: SyncBackend, trainer_on_cuda: bool, kind: EngineKind, engines_device: str
) -> GroupBackend:
    """`weight_sync.distributed.backend`, with "auto" resolved: NCCL when the trainer is on CUDA
    and the engines are on GPUs of their own (servers not started here are taken to be; engines
    started here are on "cuda:N" with N not the trainer's GPU, cuda:0), else gloo."""
    if requested != "auto":
        return requested
    if not trainer_on_cuda:
        return "gloo"
    if not kind.started_here:
        return "nccl"
    own_gpu = engines_device.startswith("cuda") and torch.device(engines_device).index not in (
        None,
        0,
    )
    return "nccl" if own_gpu else "gloo"
