"""The driver behind train.py: prepares the run and runs SFT, RL, or SFT then RL.

    prepare run dir, data, base model (one run per directory: `lock.py`, taken by `cli.py`)
      -> SFT (`sft_phase.py`)  -> checkpoints/sft/step_N/model
      -> RL (`rl_phase.py`): trainer, reference, engines, weight publisher -> the RL loop
      -> summary, plots; engines stopped (also on Ctrl-C or an error)

Resume (`--resume`): each phase continues from its latest checkpoint, verified first
(`resume.py`: a corrupt one stops the run, or falls back with checkpoint.on_corrupt), with the
DataBuffer (order, epoch, partial groups), RNG, optimizer, schedule, step and weight version.
`--resume-step N` picks step N of the phase being resumed (RL once it has checkpoints).
`--rollout-only` and `--replay RUN` run the RL phase's halves apart (`halves.py`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import trio

from rollouts import tracing
from rollouts.config import Config, RLHalves, RunMode
from rollouts.config.auto import chosen, emulated_bf16
from rollouts.driver.engines import cpu_beside_engines, cpu_share
from rollouts.driver.halves import replay_phase, rollout_only_phase
from rollouts.driver.launch import shares_node_with_driver
from rollouts.driver.placement import placement_of
from rollouts.driver.resume import resume_steps, verify_start_model
from rollouts.driver.rl_phase import rl_phase
from rollouts.driver.setup import (
    StopFlag,
    prepare_base_model,
    prepare_data,
    prepare_run_dir,
    watch_signals,
)
from rollouts.driver.sft_phase import sft_phase
from rollouts.driver.summary import finish_run
from rollouts.driver.trainer_io import BackendFactory, checkpoint_root
from rollouts.engine_kinds import engine_kind
from rollouts.heap import release_garbage
from rollouts.progress_bars import quiet_progress_bars
from rollouts.tracing import TRACE_FILE, Tracer
from rollouts.trainer.checkpoint import find_latest_checkpoint
from rollouts.trainer.factories import create_backend, resolve_device
from rollouts.weights.copies import run_sync_root
from rollouts.weights.reach import resolve_reach

if TYPE_CHECKING:
    from rollouts.trainer.mirror import BackendHub


async def _main(
    mode: RunMode,
    config: Config,
    resume: bool,
    config_path: str,
    hub: BackendHub | None = None,
    resume_step: int | None = None,
    halves: RLHalves = "both",
    replay_dir: Path | None = None,
) -> int:
    started = time.monotonic()
    _sft_threads(config)
    run_dir = prepare_run_dir(config, config_path, resume)
    if auto := chosen(config):
        print(f"[train] auto: {auto}", flush=True)
    if slow := emulated_bf16(config):
        print(f"[train] warning: {slow}", flush=True)
    make_backend = await _mirrored_factory(hub, config, run_dir)
    if mode in ("rl", "sft+rl") and halves == "both":  # first: can engines reach the weights?
        sync_root = run_sync_root(config.weight_sync.dir, config.run.name, run_dir)
        config, reach = resolve_reach(config, sync_root)
        print(reach, flush=True)
    if halves != "replay":  # a replay reads no prompt
        prepare_data(config)
    model_dir = prepare_base_model(config)
    rl_root = checkpoint_root(config, run_dir, "rl")
    sft_step, rl_step = resume_steps(mode, rl_root, resume_step)
    if mode == "rl":  # model.path may name an SFT checkpoint's model/: verified before use
        await trio.to_thread.run_sync(verify_start_model, model_dir)
    stop = StopFlag()
    tracer = Tracer(run_dir / TRACE_FILE) if config.logging.trace else None
    tracing.install(tracer)  # this run's tasks and threads see it (a trainer process: its env)
    try:
        steps = (sft_step, rl_step)
        await _phases(
            mode, config, run_dir, model_dir, resume, stop, make_backend, steps, halves, replay_dir
        )
    finally:
        if tracer is not None:
            tracer.close()
    if stop():
        print(f"[train] stopped by signal; resume with --resume (run dir {run_dir})", flush=True)
        return 130
    phase = "rl" if mode in ("rl", "sft+rl") else "sft"
    last = find_latest_checkpoint(checkpoint_root(config, run_dir, phase))
    finish_run(run_dir, time.monotonic() - started, last, plots=config.logging.plots)
    return 0


async def _phases(
    mode: RunMode,
    config: Config,
    run_dir: Path,
    model_dir: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: BackendFactory | None,
    steps: tuple[int | None, int | None],
    halves: RLHalves,
    replay_dir: Path | None,
) -> None:
    """SFT, then RL (or one of its halves), as `mode` asks, under the signal watcher."""
    sft_step, rl_step = steps
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_signals, stop, nursery.cancel_scope)
        if mode in ("sft", "sft+rl"):
            model_dir = await sft_phase(
                config, run_dir, model_dir, resume, stop, make_backend or create_backend, sft_step
            )
            print(f"[train] SFT model: {model_dir}", flush=True)
            # the SFT backend is gone: its memory back to the OS before RL builds its own
            release_garbage()
        if mode in ("rl", "sft+rl") and not stop() and halves != "both":
            args = (config, run_dir, model_dir, resume, stop, make_backend, rl_step)
            await _one_half(halves, replay_dir, *args)
        elif mode in ("rl", "sft+rl") and not stop():
            await rl_phase(
                config,
                run_dir,
                model_dir,
                resume,
                stop,
                make_backend=make_backend,
                resume_step=rl_step,
            )
        nursery.cancel_scope.cancel()


async def _one_half(
    halves: RLHalves,
    replay_dir: Path | None,
    config: Config,
    run_dir: Path,
    model_dir: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: BackendFactory | None,
    rl_step: int | None,
) -> None:
    """The RL phase's halves apart (`halves.py`): rollout-only, or the replay of a run's
    stored batches."""
    if halves == "rollout-only":
        await rollout_only_phase(config, run_dir, model_dir, stop)
        return
    assert halves == "replay" and replay_dir is not None, f"{halves=} {replay_dir=}"
    await replay_phase(config, run_dir, model_dir, replay_dir, resume, stop, make_backend, rl_step)


def _sft_threads(config: Config) -> None:
    """SFT's torch threads: a share of the cores, or every core when colocated (the RL phase
    sets its own threads: driver/placement.py)."""
    beside = 0 if placement_of(config) == "colocate" else config.engines.builtin.num_engines
    device = "cpu" if cpu_beside_engines(config) else "gpu"
    threads = cpu_share(config.training.torch_threads, device, beside)
    if threads:
        torch.set_num_threads(threads)


async def _mirrored_factory(
    hub: BackendHub | None, config: Config, run_dir: Path
) -> BackendFactory | None:
    """The torchrun hub's backend factory (None: one process), once every rank has shown it
    sees the checkpoint directory (they all write each checkpoint there)."""
    if hub is None:
        return None
    shared = Path(config.checkpoint.dir or run_dir)  # the checkpoints go under it
    await trio.to_thread.run_sync(hub.check_shared, shared)
    return hub.create


def run_training(
    mode: RunMode,
    config: Config,
    *,
    resume: bool = False,
    config_path: str = "",
    resume_step: int | None = None,
    halves: RLHalves = "both",
    replay_dir: Path | None = None,
) -> int:
    """Run `mode` ("sft", "rl" or "sft+rl") for `config`; the process exit code.
    The caller holds the run's locks (`lock.hold_run_locks`; train.py takes them before importing
    this). `resume_step`: --resume-step N (with `resume`), step N of the phase being resumed.
    `halves`: the RL phase's halves apart (--mode rl): "rollout-only", or "replay" of the
    batches `replay_dir` stored.

    Under torchrun with several ranks (the FSDP backend), rank 0 runs the driver and the other
    ranks mirror its backend calls (`trainer/mirror.py`).
    """
    quiet_progress_bars()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        args = (mode, config, resume, config_path, None, resume_step, halves, replay_dir)
        return trio.run(_main, *args)
    from rollouts.trainer.mirror import BackendHub

    if config.training.backend != "fsdp":
        raise ValueError("several torchrun ranks need training.backend = 'fsdp'")
    hub = BackendHub()
    if hub.rank != 0:
        _follower_threads(config)
        hub.follow()
        # its work is done and its process group left: skip the interpreter's teardown, where
        # gloo work objects still held by Python objects can abort a rank (SIGABRT, "terminate
        # called without an active exception"; seen in CI on rank 1 of the FSDP test workers)
        # and make torchrun report a finished run as failed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        args = (mode, config, resume, config_path, hub, resume_step, halves, replay_dir)
        return trio.run(_main, *args)
    finally:
        hub.shutdown()


def _follower_threads(config: Config) -> None:
    """A rank other than 0: its share of this node's cores (the node's ranks, and on rank 0's
    node its built-in engines too); rank 0 sets its own in the phases."""
    e = config.engines
    on_cpu = resolve_device(config.training.device).type == "cpu"
    beside = (
        e.builtin.num_engines
        if engine_kind(e.kind).started_here and shares_node_with_driver(os.environ)
        else 0
    )
    threads = cpu_share(config.training.torch_threads, "cpu" if on_cpu else "gpu", beside)
    if threads:
        torch.set_num_threads(threads)
