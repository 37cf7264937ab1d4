"""The RL loop: generate -> rewards -> advantages -> logprobs -> train -> sync, step by step.

A step is one trained batch (`rl_state`): a batch that trains nothing is counted apart, never
logged as a step, and a batch lost to the engines (EngineUnavailable) stops the run at once,
its prompts back in the buffer and the last trained step checkpointed.

Two modes (`rollout.mode`):
- "sync": each step generates its batch with the current weights, then trains on it (with
  `engines.sleep_level`, the engines sleep while it trains and wake before the step's sync).
- "async": a producer task generates the next batch while the trainer trains on the current
  one (a channel of size 0 keeps it exactly one batch ahead); with disk sync the engines load a
  step's weights while the next step trains (`weights/publisher.py`). A periodic checkpoint
  keeps the batch made ahead, so a resumed run trains the same batch, made on the same weights.
In both modes samples made by a policy more than the staleness bound (`rollout.max_staleness`;
automatic: what a fresh sample can lag, so sync stays on-policy) behind are dropped and counted,
and partial groups that would be that stale when their batch trains are dropped before they are
resumed (`rl_state.train_version`). A checkpoint step also gives the engines its weights, so a
resumed run's engines serve what the uninterrupted run's would.

The loop never knows which backend, engine or weight delivery it drives: the weights go out
through the `WeightPublisher` the driver chose once, and checkpoints and evaluation come in as
`RLHooks` (`rollouts/driver/rl_phase.py`). With `logging.save_batches` each step's batch is
written as trained (`batch_files.py`); a replay (`replay`: the stored batches of a run, read
back) runs these steps with no engines, no weight sync and no staleness filter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from rollouts import tracing
from rollouts.algorithms.kl import AdaptiveKL
from rollouts.algorithms.schedule import load_schedule
from rollouts.config import Config
from rollouts.data.buffer import DataBuffer
from rollouts.failures import failure_metrics, merge_counts
from rollouts.inference.http import EngineError
from rollouts.inference.pool import EnginePool
from rollouts.loop.batch import (
    PreparedGroups,
    prepare_groups,
    rollout_metrics,
    step_timing,
)
from rollouts.loop.batch_files import BatchWriter
from rollouts.loop.checkpoints import checkpoint, checkpoint_unsaved, rescue_checkpoint
from rollouts.loop.empty_steps import empty_batch_reason, no_update_error
from rollouts.loop.sources import Batches, BatchSource
from rollouts.loop.state import (
    MAX_EMPTY_BATCHES,
    LoopState,
    RLHooks,
    RLResult,
    StepLog,
    loop_state_from,
    train_version,
)
from rollouts.loop.train_step import train_step
from rollouts.rollout.batch import discarded_fraction
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.planning import staleness_bound
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.reference import ReferencePolicy
from rollouts.types import RolloutBatch
from rollouts.weights.publisher import WeightPublisher

WAKE_ON_ERROR_S = 30.0  # a failed step still wakes the engines, for at most this long

__all__ = ["RLHooks", "RLResult", "ReferencePolicy", "run_rl_training", "train_step"]


async def run_rl_training(
    backend: TrainingBackend,
    data_buffer: DataBuffer | None,
    rollout_manager: AsyncRolloutManager | None,
    engines: EnginePool | None,
    config: Config,
    metrics_logger: StepLog,
    *,
    weights: WeightPublisher | None,
    hooks: RLHooks,
    reward_fn: Any = None,
    ref: ReferencePolicy | None = None,
    start_step: int = 0,
    start_version: int = 0,
    loop_state: dict[str, Any] | None = None,
    replay: Batches | None = None,
    save_batches: BatchWriter | None = None,
) -> RLResult:
    """Run RL steps `start_step + 1 .. training.rl_steps` (see the module docstring). `loop_state`:
    what the checkpoint hook was given last (a resumed run passes it back); `replay`: stored
    batches to train on, with no engines (no buffer, manager, publisher); `save_batches`: where
    each step's batch is written as trained."""
    assert (replay is None) == (engines is not None), "a replay runs without engines"
    assert (engines is None) == (weights is None), f"{engines=} without {weights=}"
    is_async = config.rollout.mode == "async" and replay is None
    st = loop_state_from(
        loop_state, AdaptiveKL.from_config(config.algorithm), start_step, start_version
    )
    bound = staleness_bound(
        config.rollout.max_staleness, config.rollout.mode, config.weight_sync.every
    )
    batches: Batches
    if replay is None:
        assert rollout_manager is not None and data_buffer is not None and weights is not None
        batches = BatchSource(
            rollout_manager,
            reward_fn,
            data_buffer,
            lambda number: (str(train_version(st, number)), bound),
            weights.idle,
        )
    else:  # the stored groups passed the run's filter already (rollout-only: all version 0)
        batches, bound = replay, None
    held = batches.restore_held((loop_state or {}).get("next_batch"))
    assert held is None or held == st.batches + 1, f"{held=} does not follow {st.batches=}"
    ctx = _Ctx(
        engines=engines,
        backend=backend,
        batches=batches,
        config=config,
        hooks=hooks,
        weights=weights,
        ref=ref,
        schedule=load_schedule(config.algorithm),
        bound=bound,
        is_async=is_async,
        saver=save_batches,
    )
    await _steps(ctx, st, metrics_logger, held=held is not None)
    return RLResult(steps=st.step, weight_version=str(st.version), last_metrics=st.metrics)


async def _steps(ctx: _Ctx, st: LoopState, metrics_logger: StepLog, *, held: bool) -> None:
    """Steps until `training.rl_steps` or a stop (async: beside the producer, which starts
    after the batch a checkpoint `held`); then the delivery in flight settles."""
    async with trio.open_nursery() as nursery:
        if ctx.is_async:
            first = st.batches + 1 + held
            ctx.batches.start_producer(nursery, first, st.batches + ctx.total - st.step)
        while st.step < ctx.total:
            await _one_step_or_empty(ctx, st, ctx.engines, metrics_logger)
            if ctx.hooks.should_stop():  # (a step that saw it first has its checkpoint already)
                await checkpoint_unsaved(ctx.hooks, ctx.batches, st)
                break
        if ctx.weights is not None:  # a delivery still in flight: its error is the run's
            await ctx.weights.settle()
        nursery.cancel_scope.cancel()


async def _one_step_or_empty(
    ctx: _Ctx, st: LoopState, engines: EnginePool | None, metrics_logger: StepLog
) -> None:
    """One batch: a step, logged (with the engines' load after it), or a batch that trained
    nothing; an error first checkpoints the last trained step (`rescue_checkpoint`)."""
    try:
        metrics = await _one_batch(ctx, st)
    except Exception as error:
        await rescue_checkpoint(error, ctx.hooks, ctx.batches, st)
        raise
    if metrics is None:
        return
    if engines is not None:  # (a replay has none)
        with trio.move_on_after(5.0), contextlib.suppress(EngineError):  # their load after it
            metrics["engines/load"] = float((await engines.load()).total)
    metrics_logger.log(st.step, metrics)
    st.metrics = metrics


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Ctx:
    """What every batch of a run uses (fixed for the run)."""

    engines: EnginePool | None  # None: a replay
    backend: TrainingBackend
    batches: Batches
    config: Config
    hooks: RLHooks
    weights: WeightPublisher | None  # None: a replay
    ref: ReferencePolicy | None
    schedule: Any
    bound: int | None  # the staleness bound, computed once (None: a replay keeps every group)
    is_async: bool
    saver: BatchWriter | None = None  # logging.save_batches

    @property
    def total(self) -> int:
        return self.config.training.rl_steps


def _batch_metrics(
    rollout: RolloutBatch,
    prep: PreparedGroups,
    gen_s: float,
    wait_s: float,
    is_async: bool,
    phase: str = "generate",
) -> tuple[dict[str, float], dict[str, float]]:
    """A batch's rollout metrics and its first phase time."""
    metrics = rollout_metrics(prep.groups, rollout.metadata)
    # failed samples of every group the batch saw (a group of FAILED ones is never kept)
    failed = int(rollout.metadata.get("failed_samples", prep.failed_samples))
    # the groups dropped here as stale are thrown away too (rollout/discarded_fraction)
    discarded = int(rollout.metadata.get("discarded_tokens", 0)) + prep.stale_tokens
    generated = int(rollout.metadata.get("generated_tokens", 0))
    metrics |= {
        "rollout/failed_samples": float(failed),
        "rollout/stale_groups_dropped": float(prep.stale_groups),
        "rollout/staleness_max": float(prep.max_staleness_seen),
        "rollout/discarded_tokens": float(discarded),
        "rollout/discarded_fraction": discarded_fraction(discarded, generated),
    }
    if is_async:
        metrics["time/generate_overlapped_s"] = gen_s
    return metrics, {phase: wait_s if is_async else gen_s}


def _count_empty(st: LoopState, number: int, rollout: RolloutBatch, prep: PreparedGroups) -> None:
    """Batch `number` trained nothing: counted apart, said on the console (with why); the run
    stops after `MAX_EMPTY_BATCHES` in a row (NoUpdateError)."""
    st.empty_batches += 1
    st.empty_in_a_row += 1
    st.empty_since_step += 1
    failed = rollout.metadata.get("failures", {})
    st.failures_since_step = merge_counts(st.failures_since_step, failed)
    reason = empty_batch_reason(rollout, prep.stale_groups) or "no trainable sample"
    if st.empty_in_a_row >= MAX_EMPTY_BATCHES:
        raise no_update_error(st.empty_in_a_row, st.step, reason)
    n = f"{st.empty_in_a_row}/{MAX_EMPTY_BATCHES} in a row"
    print(f"[train] batch {number} trained nothing (not a step, {n}): {reason}", flush=True)


async def _one_batch(ctx: _Ctx, st: LoopState) -> dict[str, float] | None:
    """Take the next batch and train one step on it; None when it trained nothing."""
    number = st.batches + 1
    started = time.monotonic()
    rollout, gen_s = await ctx.batches.next(number)
    waited = time.monotonic() - started
    wait_s = tracing.phase(ctx.batches.phase, waited, start_s=started, batch=number)
    prep = prepare_groups(rollout.groups, str(st.version), ctx.bound)
    metrics, times = _batch_metrics(rollout, prep, gen_s, wait_s, ctx.is_async, ctx.batches.phase)
    if ctx.hooks.report_batch is not None:  # failures said and written, trained or not
        ctx.hooks.report_batch(st.step + 1, number, rollout)
    if not prep.groups:
        _count_empty(st, number, rollout, prep)
        st.batches = number
        ctx.batches.raise_limit(st.batches + ctx.total - st.step)  # one more batch to make
        return None
    step = st.step + 1
    algo = st.kl_ctl.steer(ctx.schedule(step - 1))  # the adaptive KL coefficient, if any
    st.in_backend = True
    async with _engines_asleep(ctx, times):
        trained = await train_step(ctx.backend, prep.groups, algo, ctx.config, ctx.ref)
        metrics |= trained.metrics
        if trained.reward_kl is not None:  # verl: n_steps = the batch size
            n_seqs = sum(len(g) for g in prep.groups)
            st.kl_ctl = st.kl_ctl.update(trained.reward_kl, n_seqs)
        times |= trained.times
        st.version += 1
        st.step, st.step_batch, st.batches = step, number, number
        if ctx.ref is not None:
            await ctx.ref.update(ctx.backend, algo, step)
    st.in_backend = False
    ctx.batches.forget_before(number + 1)
    metrics["rollout/empty_batches"] = float(st.empty_since_step)
    failed = merge_counts(rollout.metadata.get("failures", {}), st.failures_since_step)
    metrics |= failure_metrics(failed, "rollout")  # with the batches that trained nothing
    st.failures_since_step = {}
    # known now, so the line a resumed run writes from a rescue checkpoint (the step trained,
    # then its weight sync failed) has it too
    metrics["policy/version"] = float(st.version)
    st.empty_in_a_row = st.empty_since_step = 0
    st.step_metrics = metrics  # what a rescue checkpoint stores if the step fails from here
    if ctx.saver is not None:  # the batch as trained, at the version it trained at
        args = (step, number, st.version - 1, prep.groups, rollout.metadata, trained.batch)
        times["save_batch"] = tracing.phase("save_batch", await ctx.saver.write(*args))
    times |= await _after_training(ctx, st, metrics)
    tracing.samples_trained(rollout.groups, prep.groups, step)
    step_s = tracing.phase(f"step {step}", time.monotonic() - started, start_s=started)
    tracing.flush()
    return metrics | step_timing(times, step_s, rollout, st.version)


@contextlib.asynccontextmanager
async def _engines_asleep(ctx: _Ctx, times: dict[str, float]) -> AsyncIterator[None]:
    """With `engines.sleep_level` (colocated sync mode), the engines sleep while the trainer
    trains and wake before the step's weight sync (which reloads a level-2 sleep's weights).
    On an error they are woken (bounded, its own error dropped) so a next run finds them up."""
    level = ctx.config.engines.sleep_level
    if not level or ctx.engines is None:
        yield
        return
    started = time.monotonic()
    await ctx.engines.sleep(level)
    times["sleep"] = tracing.phase("sleep", time.monotonic() - started, start_s=started)
    try:
        yield
    except BaseException:
        shield = trio.CancelScope(shield=True)
        with shield, trio.move_on_after(WAKE_ON_ERROR_S), contextlib.suppress(Exception):
            await ctx.engines.wake_up()
        raise
    started = time.monotonic()
    await ctx.engines.wake_up()
    times["wake"] = tracing.phase("wake", time.monotonic() - started, start_s=started)


@dataclasses.dataclass(frozen=True, slots=True)
class _Due:
    """What a step must do after training (each decided once, from the step number)."""

    sync: bool
    urgent: bool  # the engines must serve the step's weights when the sync returns
    eval: bool
    checkpoint: bool
    periodic: bool  # a periodic checkpoint (not the last step's, not a stop's)


def _due(ctx: _Ctx, st: LoopState, stopping: bool) -> _Due:
    step, c = st.step, ctx.config
    every = c.checkpoint.every
    periodic = bool(every) and step % every == 0 and step < ctx.total and not stopping
    checkpoint_due = periodic or step == ctx.total or stopping
    eval_every = c.training.eval_every
    eval_due = ctx.hooks.evaluate is not None and (
        bool(eval_every and step % eval_every == 0) or step == ctx.total
    )
    # a checkpoint step syncs too: a resumed run's engines start on its weights
    sync_due = step % c.weight_sync.every == 0 or eval_due or checkpoint_due
    return _Due(
        sync=sync_due and st.synced != st.version and ctx.weights is not None,
        urgent=eval_due or stopping or step == ctx.total,
        eval=eval_due,
        checkpoint=checkpoint_due,
        periodic=periodic,
    )


async def _after_training(ctx: _Ctx, st: LoopState, metrics: dict[str, float]) -> dict[str, float]:
    """The step's weight sync, evaluation and checkpoint (each when due); their times."""
    due = _due(ctx, st, ctx.hooks.should_stop())
    times: dict[str, float] = {}
    if due.sync:
        times["sync"] = await _timed("sync", _sync, ctx, st, metrics, due)
    if due.eval:
        times["eval"] = await _timed("eval", _evaluate, ctx, st, metrics, due)
    if due.checkpoint:
        times["checkpoint"] = await _timed("checkpoint", _checkpoint, ctx, st, metrics, due)
    return times


async def _timed(
    name: str, phase: Any, ctx: _Ctx, st: LoopState, metrics: dict, due: _Due
) -> float:
    started = time.monotonic()
    await phase(ctx, st, metrics, due)
    return tracing.phase(name, time.monotonic() - started, start_s=started)


async def _sync(ctx: _Ctx, st: LoopState, metrics: dict[str, float], due: _Due) -> None:
    """Give the engines the step's weights (an overlapped publisher: in the background, unless
    urgent); the `sync/*` figures known now go on the step's line."""
    assert ctx.weights is not None, "a replay has no engines to sync"
    metrics |= await ctx.weights.publish(str(st.version), urgent=due.urgent)
    st.synced = st.version


async def _evaluate(ctx: _Ctx, st: LoopState, metrics: dict[str, float], due: _Due) -> None:
    assert ctx.weights is not None, "a replay has no engines to evaluate on"
    metrics |= await ctx.weights.settle()  # the engines serve the newest weights (none in flight)
    assert ctx.hooks.evaluate is not None
    metrics |= await ctx.hooks.evaluate(st.step)


async def _checkpoint(ctx: _Ctx, st: LoopState, metrics: dict[str, float], due: _Due) -> None:
    if due.periodic and ctx.is_async:  # kept in the checkpoint: see the module docstring
        await ctx.batches.take_ahead(st.step_batch + 1)
    await checkpoint(ctx.hooks, ctx.batches, st, metrics)
