"""Rollout-only and replay runs (`--rollout-only`, `--replay RUN`): the RL phase's two halves,
each alone, over the batches a run stores (`loop/batch_files.py`).

    --rollout-only: data, the engines on the starting model (the teacher's and the judge's
      when asked), the manager -> `loop/halves.run_rollout_only` -> RUN/batches/. No trainer is
      built: no optimizer, no weight sync (the engines keep the base weights), no checkpoint,
      no held-out evaluation.
    --replay RUN: RUN/batches/ checked against the config -> the trainer (here or in its own
      process, with the threads the run would give it) -> checkpoint resume -> reference
      -> the RL loop on `ReplaySource`: no engine, no weight sync, no held-out evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import trio

from rollouts.config import Config
from rollouts.config.rollout import resolved_concurrency
from rollouts.driver.engines import open_engines
from rollouts.driver.failures import BatchReporter
from rollouts.driver.metrics import MetricsLogger, last_step
from rollouts.driver.placement import cpu_plan, pinned
from rollouts.driver.reference_setup import open_reference
from rollouts.driver.resume import checkpoint_to_resume
from rollouts.driver.rl_phase import (
    _policy_backend,
    _rl_inputs,
    _set_trainer_threads,
    _trainer_host,
    write_rl_checkpoint,
)
from rollouts.driver.rl_run import Resumed
from rollouts.driver.served import open_judge, open_teacher
from rollouts.driver.setup import RL_METRICS, StopFlag, make_logger, with_response_text
from rollouts.driver.trainer_io import BackendFactory, checkpoint_root
from rollouts.gateway import open_agent_generate
from rollouts.gcpolicy import freeze_startup_objects
from rollouts.loop.batch_files import BatchWriter, batch_writer, batches_root, check_replay
from rollouts.loop.halves import BASE_VERSION, ReplaySource, run_rollout_only
from rollouts.loop.rl import RLHooks, run_rl_training
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.trainer.checkpoint import STEP_DIR, clean_leftovers, load_checkpoint
from rollouts.trainer.factories import create_backend, load_tokenizer
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.reference import ReferencePolicy


async def replay_phase(
    config: Config,
    run_dir: Path,
    model_dir: Path,
    replay_dir: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: BackendFactory | None = None,
    resume_step: int | None = None,
) -> dict[str, float]:
    """Train `training.rl_steps` steps from `model_dir` (or this run's checkpoint) on the
    batches `replay_dir` stored; the last step's metrics."""
    root = checkpoint_root(config, run_dir, "rl")
    clean_leftovers(root)
    latest = await checkpoint_to_resume(config, root, "rl", resume=resume, step=resume_step)
    stored = batches_root(replay_dir)
    first = _step_of(latest) + 1
    check_replay(config, stored, first, config.training.rl_steps)  # before anything is built
    print(
        f"[replay] steps {first}..{config.training.rl_steps} train on the batches in {stored}: "
        "no engines, no weight sync; the held-out evaluation is skipped",
        flush=True,
    )
    plan = cpu_plan(config)  # the threads the run that stored them gave its trainer
    _set_trainer_threads(config, plan)
    host = _trainer_host(config, plan, custom_backend=make_backend is not None)
    make = host.create if host is not None else make_backend or create_backend
    backend = ref = None
    try:
        backend = _policy_backend(config, make, model_dir, plan)
        resumed = await _resume(backend, latest)
        ref = await open_reference(config, model_dir, make, plan, latest, backend)
        replay = _Replay(config=config, run_dir=run_dir, backend=backend, ref=ref, stop=stop)
        with pinned(plan.driver if plan is not None else ()):
            pid = host.pid if host is not None else None
            return await _train(replay, resumed, ReplaySource(stored, config), pid)
    finally:
        for opened in (backend, ref.backend if ref is not None else None, host):
            if opened is not None:
                opened.close()


def _step_of(checkpoint: Path | None) -> int:
    if checkpoint is None:
        return 0
    found = STEP_DIR.match(checkpoint.name)
    assert found is not None, f"{checkpoint} is not a step_NNNNNN checkpoint"
    return int(found.group(1))


async def _resume(backend: TrainingBackend, latest: Path | None) -> Resumed:
    """Load this run's checkpoint (nothing for a new replay). A replay numbers its batches by
    step, whatever the checkpoint's run numbered them; its DataBuffer state is not used."""
    if latest is None:
        return Resumed()
    state = await trio.to_thread.run_sync(load_checkpoint, backend, latest)
    loop_state = dict(state.extra_state.get("rl_loop", {}))
    loop_state.pop("next_batch", None)  # an async run's batch made ahead: the replay reads it
    return Resumed(
        step=state.step,
        version=int(state.weight_version),
        metrics=state.extra_state.get("metrics"),
        loop_state=loop_state | {"batch": state.step},
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Replay:
    """What a replay built: the trainer side of an RL phase, and nothing else."""

    config: Config
    run_dir: Path
    backend: TrainingBackend
    ref: ReferencePolicy | None
    stop: StopFlag


async def _train(
    r: _Replay, resumed: Resumed, source: ReplaySource, trainer_pid: int | None
) -> dict[str, float]:
    """The RL loop on the stored batches, with this run's checkpoints and metrics.jsonl."""
    config, path = r.config, r.run_dir / RL_METRICS
    total = config.training.rl_steps
    logger = make_logger(config, path, total, "replay ", resumed.step or None, trainer_pid)
    last = last_step(path)
    if resumed.step and resumed.metrics and (last is None or last < resumed.step):
        logger.log(resumed.step, resumed.metrics)
    saver = batch_writer(config, r.run_dir, resumed.step)
    hooks = RLHooks(checkpoint=functools.partial(_checkpoint, r), should_stop=r.stop)
    freeze_startup_objects()
    try:
        result = await run_rl_training(
            r.backend,
            None,
            None,
            None,
            config,
            logger,
            weights=None,
            hooks=hooks,
            ref=r.ref,
            start_step=resumed.step,
            start_version=resumed.version,
            loop_state=resumed.loop_state,
            replay=source,
            save_batches=saver,
        )
    finally:
        logger.close()
    return result.last_metrics


async def _checkpoint(
    r: _Replay,
    step: int,
    version: str,
    buffer_state: dict[str, Any],
    metrics: Any = None,
    loop_state: dict[str, Any] | None = None,
) -> None:
    """The loop's checkpoint hook, as the RL phase's (`buffer_state`: where the batches come
    from, in place of a DataBuffer's)."""
    states = (buffer_state, metrics, loop_state)
    await write_rl_checkpoint(r.config, r.run_dir, r.backend, r.ref, step, version, states)


async def rollout_only_phase(
    config: Config, run_dir: Path, model_dir: Path, stop: StopFlag, reward_fn: Any = None
) -> dict[str, float]:
    """Generate and score `training.rl_steps` batches on `model_dir` and store them in
    `run_dir/batches/` for a later `--replay`; the last batch's metrics."""
    tokenizer = load_tokenizer(model_dir)
    buffer, _, reward = _rl_inputs(config, tokenizer, model_dir, reward_fn)
    plan = cpu_plan(config)  # the engines' threads of a run with a trainer
    writer = BatchWriter(batches_root(run_dir), config, 0)
    print(
        f"[rollout-only] {config.training.rl_steps} batches into {writer.root}, all made by the "
        "starting weights: no trainer, no weight sync, no checkpoint; the held-out evaluation "
        "is skipped",
        flush=True,
    )
    async with (
        open_engines(config, model_dir, BASE_VERSION, (model_dir,), plan=plan) as pool,
        open_teacher(config, tokenizer) as teacher,
        open_judge(config) as judge,
    ):
        score = reward if judge is None else with_response_text(judge, tokenizer)
        rollout = dataclasses.replace(
            config.rollout, max_concurrency=resolved_concurrency(config.rollout, config.engines)
        )
        async with open_agent_generate(rollout) as agent_fn:
            manager = AsyncRolloutManager(
                buffer,
                rollout,
                pool,
                tokenizer=tokenizer,
                generate_fn=agent_fn,
                reward_fn=score,
                seed=config.run.seed,
                reward_shaping=config.reward,
                teacher=teacher,
            )
            logger = make_logger(
                config, run_dir / RL_METRICS, config.training.rl_steps, "rollout ", None
            )
            report = BatchReporter(
                logger=logger,
                decode=functools.partial(tokenizer.decode, skip_special_tokens=True),
                rows_per_step=config.logging.rollouts_per_step,
            )
            freeze_startup_objects()
            with pinned(plan.driver if plan is not None else ()):
                return await _generate(manager, buffer, config, logger, writer, stop, report, score)


async def _generate(
    manager: AsyncRolloutManager,
    buffer: Any,
    config: Config,
    logger: MetricsLogger,
    writer: BatchWriter,
    stop: StopFlag,
    report: BatchReporter,
    score: Any,
) -> dict[str, float]:
    try:
        result = await run_rollout_only(
            manager,
            buffer,
            config,
            logger,
            writer=writer,
            should_stop=stop,
            report_batch=report,
            reward_fn=score,
        )
    finally:
        logger.close()
    print(
        f"[rollout-only] {result.steps} batches in {writer.root}; train on them with "
        f"--replay {writer.root.parent}",
        flush=True,
    )
    return result.last_metrics
