"""The distributed weight sync over an EnginePool: the engines that are up (and those back up),
the failing ones marked down, fatal only when none is left.

The group is a collective: one engine failing fails the bucket for all. The engines whose own
call failed are marked down and the others are synced again at once in a group without them
(bounded: each retry drops at least one engine). There is no file to reload from, so an engine
that comes back is not routed to (the pool records no weights path) until the next sync, which
takes every engine that answers /health into the group and marks it up once it serves the version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import torch

from rollouts.config import Config
from rollouts.engine_kinds import EngineKind, engine_kind
from rollouts.inference.http import EngineError, EngineUnavailable
from rollouts.inference.pool import EnginePool
from rollouts.trainer.factories import resolve_device
from rollouts.weights.check import WeightContentError, WeightProbe, check_engine
from rollouts.weights.disk import SyncReport, WeightSyncError
from rollouts.weights.distributed import DistributedWeightSync, DistSyncOptions
from rollouts.weights.reach import LOCAL_MASTER


async def _reachable(pool: EnginePool) -> list[int]:
    """Engines that are up, and down ones that answer /health again (they rejoin the group)."""
    return [i for i, up in enumerate(pool.up) if up or await pool.engines[i].health()]


async def sync_pool_distributed(
    pool: EnginePool,
    sender: DistributedWeightSync,
    get_weights: Callable[[], Mapping[str, torch.Tensor]],
    version: str,
    *,
    pause_mode: str = "abort",
    step: int | None = None,
    probe: WeightProbe | None = None,
) -> SyncReport:
    """Broadcast the trainer's weights to the pool's live engines as `version`; with a `probe`,
    the engines that do not serve them (`weight_check`) are marked down.

    Raises EngineUnavailable when no engine is up within `pool.wait_for_up_s`, WeightSyncError
    when no engine took the new weights (or the trainer's side failed), WeightContentError when
    none of those that took them serves them.
    """
    if not await pool.wait_for_up():
        raise EngineUnavailable(
            f"weight sync to version {version!r}: no engine of {pool.url} is up after "
            f"{pool.wait_for_up_s}s; the run stops (resume it with --resume)"
        )
    async with pool.weights_lock:
        live = await _reachable(pool)
        if not live:
            raise EngineUnavailable(f"weight sync to version {version!r}: every engine is down")
        while True:
            engines = [pool.engines[i] for i in live]
            try:
                report = await sender.sync(
                    engines, get_weights, version, pause_mode=pause_mode, step=step
                )
                break
            except WeightSyncError:
                failed = [i for i in live if pool.engines[i].url in sender.culprits]
                for i in failed:
                    pool.mark_down(i)
                    print(f"[engines] {pool.engines[i].url} marked down (weight sync failed)")
                live = [i for i in live if i not in failed]
                if not failed or not live:
                    raise
        if probe is not None:
            live, report = await _serving(pool, live, probe, report, step)
        for i in live:
            pool.up[i] = True
        # no weights path: a returning engine must not reload old files under the new version
        pool.weights_path, pool.version = None, str(version)
    return dataclasses.replace(report, engines_down=len(pool.engines) - len(live))


async def _serving(
    pool: EnginePool, live: list[int], probe: WeightProbe, report: SyncReport, step: int | None
) -> tuple[list[int], SyncReport]:
    """The engines of `live` whose content check passes (the others marked down), and the
    report with the check's figures; WeightContentError when none passes."""
    started = time.perf_counter()
    kept, gaps, errors = [], [], []
    for i in live:
        try:
            gaps.append(await check_engine(pool.engines[i], probe, step))
        except (WeightContentError, EngineError) as exc:
            pool.mark_down(i)
            print(f"[engines] {pool.engines[i].url} marked down: {exc}", flush=True)
            errors.append(str(exc))
            continue
        kept.append(i)
    if not kept:
        raise WeightContentError("\n".join(errors))
    stats = {"check_s_max": time.perf_counter() - started, "content_gap_max": max(gaps)}
    return kept, dataclasses.replace(report, stats=report.stats | stats)


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
    requested: str, trainer_on_cuda: bool, kind: EngineKind, engines_device: str
) -> str:
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
