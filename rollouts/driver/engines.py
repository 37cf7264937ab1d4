"""Engines for a run: built-in `rollouts serve` processes, or running SGLang / vLLM servers.

Either way the loop gets one `EnginePool` (an InferenceEngine) with periodic health checks, whose
clients use `engines.request_timeout_s` and `engines.max_retries`. Built-in engines
([engines.builtin]) are started on the given model with the given weight version, die with the
trainer (parent-death signal), are restarted (at most `engines.builtin.max_restarts` times each)
when one exits, and are stopped when the block exits (also on Ctrl-C or an error); each logs to
`<run dir>/engines/engine-<i>.log`. One with no
restart left is gone for good, and no request waits for it (`EnginePool.mark_gone`); external
servers are waited for (up to `engines.startup_timeout_s`, naming the URLs still loading) and
then made to serve the run's starting weights with a weight sync. An engine that comes back
loads the pool's current weights before it gets a request (`EnginePool.check_health`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import trio

from rollouts.config import Config
from rollouts.config.auto import attention, engine_autocast, engine_dtype
from rollouts.driver.launch import local_world_size
from rollouts.driver.placement import CpuPlan
from rollouts.engine.launch import EngineSpec, serve_engines
from rollouts.engine_kinds import engine_kind
from rollouts.inference.factory import make_pool
from rollouts.inference.pool import EnginePool
from rollouts.inference.readiness import wait_until_ready
from rollouts.trainer.factories import resolve_device
from rollouts.weights.disk import DiskDelivery


def cpu_share(threads: int, device: str, num_engines: int) -> int:
    """Torch threads for a process on CPU: as configured, else an equal share of the cores.

    Each trainer rank on this node (torchrun's LOCAL_WORLD_SIZE, 1 without it) and each built-in
    engine get cores // (engines + ranks): on a 2-core laptop that is 1 thread each, which avoids
    OpenMP spin-waits of oversubscribed processes (measured: a step went from 9 s to 0.3 s on a
    loaded 2-core machine). 0 (torch's default) on GPU.
    """
    if threads or device != "cpu":
        return threads
    ranks = local_world_size(os.environ)
    return max(1, (os.cpu_count() or 1) // (num_engines + ranks))


def cpu_beside_engines(config: Config) -> bool:
    """Whether the trainer runs on CPU beside engines the run starts on this machine (then its
    torch threads are a share of the cores: `cpu_share`)."""
    on_cpu = resolve_device(config.training.device).type == "cpu"
    return on_cpu and engine_kind(config.engines.kind).started_here


def engine_threads(config: Config, plan: CpuPlan | None) -> int:
    """Each built-in engine's torch threads: the CPU plan's, else as set or a share."""
    b = config.engines.builtin
    if plan is not None:
        return plan.engine_threads
    return cpu_share(b.torch_threads, b.device, b.num_engines)


def engine_logs(config: Config, name: str = "engine") -> tuple[str, ...]:
    """Where the built-in engines log: `<run dir>/engines/<name>-<i>.log` (made here)."""
    logs = Path(config.run.output_dir) / "engines"
    logs.mkdir(parents=True, exist_ok=True)
    return tuple(str(logs / f"{name}-{i}.log") for i in range(config.engines.builtin.num_engines))


def current_weights(pool: EnginePool | None) -> tuple[str, str] | None:
    """(model dir, version) the pool's engines serve now, for restarting a built-in engine;
    None when they serve a LoRA adapter (it restarts on its base model, then loads the adapter
    before its first request: `EnginePool.check_health`)."""
    weights = pool.weights if pool is not None else None
    if weights is None or weights.path is None or weights.adapter:
        return None
    return weights.path, weights.version


def builtin_spec(
    config: Config,
    model_dir: Path,
    version: str,
    weights_roots: Sequence[Path],
    plan: CpuPlan | None,
) -> EngineSpec:
    """How each built-in engine starts: [engines.builtin], with what the run sets itself (the
    model and version it starts on, a free port, the key, the trainer's attention, threads)."""
    e = config.engines
    options = dataclasses.replace(
        e.builtin,
        model=str(model_dir),
        port=0,
        api_key=e.api_key,
        attn_implementation=attention(config.model.attn_implementation, e.builtin.device),
        dtype=engine_dtype(config, e.builtin),
        autocast=engine_autocast(config, e.builtin),
        torch_threads=engine_threads(config, plan),
        weight_version=version,
        weights_roots=tuple(str(Path(r).resolve()) for r in weights_roots),
    )
    return EngineSpec(options=options, startup_timeout_s=e.startup_timeout_s)


@contextlib.asynccontextmanager
async def open_engines(
    config: Config,
    model_dir: Path,
    version: str,
    weights_roots: Sequence[Path] = (),
    plan: CpuPlan | None = None,
    *,
    name: str = "engine",
    load_at_start: bool = True,
) -> AsyncIterator[EnginePool]:
    """An EnginePool over built-in engine processes (started here, stopped on exit) or URLs.

    Built-in engines reload weights only from inside `weights_roots` when any is given (the
    run's starting model and its weight-copy directory), so no other local process can make
    them serve weights of its choosing. `name`: the engines' log names. `load_at_start` false:
    servers at URLs are only waited for, never told to load weights (a teacher's: they serve
    their own model, proven by the caller)."""
    e, b = config.engines, config.engines.builtin
    pool: EnginePool | None = None  # built below; a restart asks it for the current weights
    async with trio.open_nursery() as nursery:
        here = engine_kind(e.kind).started_here
        if here:
            urls = await nursery.start(
                functools.partial(
                    serve_engines,
                    builtin_spec(config, model_dir, version, weights_roots, plan),
                    b.num_engines,
                    max_restarts=b.max_restarts,
                    restart_from=lambda: current_weights(pool),
                    on_gone=lambda url: pool.mark_gone(url) if pool is not None else None,
                    cpus_per_engine=plan.engines if plan is not None and not plan.colocated else (),
                    log_paths=engine_logs(config, name),
                )
            )
        else:
            urls = list(e.urls)
        pool = make_pool(e, urls)
        pool.set_weights(str(model_dir), version)  # what a restarted engine must load
        try:
            if not here:  # servers of their own: wait for them, then our starting weights
                await wait_until_ready(pool.engines, e.startup_timeout_s)
                if load_at_start:
                    await pool.sync(DiskDelivery(path=str(model_dir), version=version))
            await nursery.start(pool.run_health_checks)
            yield pool
        finally:  # the health checks stop before the clients close: a check due during
            nursery.cancel_scope.cancel()  # the close would send on a closed client
            with trio.CancelScope(shield=True):
                await pool.aclose()
