"""The RL loop: generate -> rewards -> advantages -> logprobs -> train -> sync, step by step.

Two modes (`rollout.mode`):
- "sync": each step generates its batch with the current weights, then trains on it.
- "async": a producer task generates the next batch while the trainer trains on the current
  one (a channel of size 0 keeps it exactly one batch ahead); with disk sync the engines load a
  step's weights while the next step trains (`rl_sources.EngineSync`).
In both modes samples made by a policy more than the staleness bound (`rollout.max_staleness`;
automatic: what a fresh sample can lag, so sync stays on-policy) behind are dropped and counted,
and partial groups that would be that stale when their batch trains are dropped before they are
resumed (`rl_sources.train_version`).

The loop never knows which backend or which engine it drives: checkpoints, weight sync and
evaluation come in as `RLHooks` built by the driver (`rollouts/training/run.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from rollouts.algorithms.kl import AdaptiveKL, kl_reward_penalties, sequence_mean_kl
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.algorithms.pairwise import groups_of, prepare_pairwise_batch
from rollouts.algorithms.reference import update_reference
from rollouts.algorithms.schedule import load_schedule
from rollouts.config import AlgorithmConfig, Config
from rollouts.inference.http import EngineError
from rollouts.rollout.planning import staleness_bound
from rollouts.training.loops.rl_batch import (
    epoch_metrics,
    mini_batches,
    needs_old_logprobs_pass,
    prefixed,
    prepare_groups,
    rollout_metrics,
    train_batch_of,
    value_input_batch,
)
from rollouts.training.loops.rl_sources import BatchSource, Delivery, EngineSync, train_version
from rollouts.training.metrics import MetricsLogger
from rollouts.types import RolloutBatch, TrainBatch

MAX_EMPTY_STEPS = 3  # steps in a row without a trainable sample before the run stops


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLHooks:
    """What the driver plugs into the loop (all async; each returns quickly or is bounded)."""

    # (step, version, buffer_state, *, metrics, loop_state): metrics = the step's (train + eval),
    # so the driver can keep the best checkpoint (`checkpoint.best_metric`); loop_state = the
    # loop's own JSON-safe state (e.g. the adaptive KL coefficient), given back on resume
    checkpoint: Callable[..., Awaitable[None]]
    sync_weights: Callable[[str], Awaitable[dict[str, float]]]  # version -> phase times
    # async mode: write the version's weights where the engines load them (awaited, so the
    # next optimizer step cannot change them first) and return the delivery (pause, load,
    # resume, verify), which runs while the next step trains; None = always `sync_weights`
    publish_weights: Callable[[str], Awaitable[Delivery]] | None = None
    evaluate: Callable[[], Awaitable[dict[str, float]]] | None = None
    should_stop: Callable[[], bool] = lambda: False
    log_samples: Callable[[int, RolloutBatch], None] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLResult:
    """Where an RL run ended."""

    steps: int
    weight_version: str
    last_metrics: dict[str, float]


class ReferencePolicy:
    """The reference model (for KL): a logprob-only backend and its update strategy."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.params = backend.get_weights()
        self.changed = False  # moved off the base model: checkpointed from then on

    def restore(self, params: Any) -> None:
        """Load reference parameters saved in a checkpoint (a resumed run)."""
        self.params, self.changed = params, True
        self.backend.load_weights(params)

    def params_to_checkpoint(self) -> Any:
        """The parameters a checkpoint must keep: None while they are the base model's."""
        return self.params if self.changed else None

    async def logprobs(self, batch: TrainBatch) -> tuple[Any, ...]:
        return await self.backend.compute_logprobs(batch)

    async def update(self, policy_backend: Any, algo: AlgorithmConfig, step: int) -> None:
        """Apply `algo.ref_update` after optimizer step `step`."""
        if algo.ref_update == "none":
            return
        policy = await trio.to_thread.run_sync(policy_backend.get_weights)
        new = update_reference(self.params, policy, algo, step)
        if new is not self.params:
            self.params, self.changed = new, True
            await trio.to_thread.run_sync(self.backend.load_weights, new)


async def _logprobs_for(
    batch: TrainBatch,
    backend: Any,
    ref: ReferencePolicy | None,
    algo: AlgorithmConfig,
    separate_old: bool,
) -> tuple[TrainBatch, float]:
    """Old logprobs when a separate pass is needed (`needs_old_logprobs_pass`) and reference
    logprobs. Without old logprobs the loss takes them from the training forward (ratio = 1),
    and the engine/trainer mismatch and TIS too."""
    started = time.monotonic()
    if separate_old:
        old = await backend.compute_logprobs(batch)
        batch = dataclasses.replace(batch, old_logprobs=tuple(old))
    if make_loss_fn(algo).needs_ref_logprobs:
        if ref is None:
            raise ValueError(
                "algorithm.kl_coef > 0 or policy_loss = 'pairwise' needs a reference model "
                "(none was built)"
            )
        batch = dataclasses.replace(batch, ref_logprobs=tuple(await ref.logprobs(batch)))
    return batch, time.monotonic() - started


async def _critic_values(
    backend: Any, groups: Any, algo: AlgorithmConfig
) -> tuple[Any, ...] | None:
    """The critic's values before the update (GAE needs them); None for other estimators."""
    if algo.advantage != "gae":
        return None
    if not hasattr(backend, "compute_values"):
        raise ValueError(
            "algorithm.advantage = 'gae' needs a critic: the backend has no compute_values"
        )
    return tuple(await backend.compute_values(value_input_batch(groups)))


async def _kl_in_reward_batch(
    groups: Any,
    algo: AlgorithmConfig,
    config: Config,
    backend: Any,
    ref: ReferencePolicy,
    values: tuple[Any, ...] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """KL in the reward: per-token penalties from old vs reference logprobs, then advantages."""
    max_new = config.rollout.sampling.max_new_tokens
    plain = train_batch_of(groups, algo, max_new_tokens=max_new, values=values)
    old = await backend.compute_logprobs(plain)
    ref_lp = await ref.logprobs(plain)
    penalties, batch_kl = kl_reward_penalties(old, ref_lp, plain.loss_mask, algo, algo.kl_coef)
    batch = train_batch_of(
        groups, algo, max_new_tokens=max_new, kl_penalties=penalties, values=values
    )
    batch = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=tuple(ref_lp))
    seq_kl = sequence_mean_kl(old, ref_lp, plain.loss_mask, algo)
    return batch, {
        "train/reward_kl": batch_kl,
        "train/reward_kl_seq_mean": seq_kl,
        "train/kl_coef": algo.kl_coef,
    }


async def train_step(
    backend: Any, groups: Any, algo: AlgorithmConfig, config: Config, ref: ReferencePolicy | None
) -> tuple[dict[str, float], dict[str, float]]:
    """Advantages, logprobs and `ppo_epochs` x mini-batch optimizer steps; (metrics, times)."""
    max_new = config.rollout.sampling.max_new_tokens
    times: dict[str, float] = {}
    extra: dict[str, float] = {}
    started = time.monotonic()
    values = await _critic_values(backend, groups, algo)
    if values is not None:
        times["values"] = time.monotonic() - started
    if algo.kl_in == "reward" and algo.kl_coef > 0.0 and ref is not None:
        started = time.monotonic()
        batch, extra = await _kl_in_reward_batch(groups, algo, config, backend, ref, values)
        times["logprobs"] = time.monotonic() - started
        # the KL is in the reward, not the loss (the controller, if any, already steered it)
        algo = dataclasses.replace(algo, kl_coef=0.0, kl_target=0.0)
    else:
        batch = train_batch_of(groups, algo, max_new_tokens=max_new, values=values)
        separate = needs_old_logprobs_pass(algo, len(mini_batches(groups, algo.mini_batch_size)))
        batch, times["logprobs"] = await _logprobs_for(batch, backend, ref, algo, separate)
    loss_fn = make_loss_fn(algo)
    started = time.monotonic()
    summed: dict[str, float] = {}
    per_epoch: list[dict[str, float]] = []
    n_updates = 0
    for _ in range(algo.ppo_epochs):
        per_epoch.append({"_n": 0.0})
        for indices in mini_batches(groups, algo.mini_batch_size):
            mb = batch if len(indices) == len(batch) else _renormalised(batch, indices)
            if algo.policy_loss == "pairwise":  # per mini-batch: each divides by its own pairs
                mb = prepare_pairwise_batch(mb, groups_of(groups, indices), algo)
            fb = await backend.forward_backward(mb, loss_fn, entropy=True)
            opt = await backend.optim_step()
            for key, value in {**fb, **opt}.items():
                summed[key] = summed.get(key, 0.0) + float(value)
                per_epoch[-1][key] = per_epoch[-1].get(key, 0.0) + float(value)
            per_epoch[-1]["_n"] += 1.0
            n_updates += 1
    times["train"] = time.monotonic() - started
    metrics = {k: v / n_updates for k, v in summed.items()}  # mean over optimizer updates
    metrics = prefixed(metrics, "train") | extra
    if algo.ppo_epochs > 1 or values is not None:
        metrics |= epoch_metrics(per_epoch)
    metrics["train/updates"] = float(n_updates)
    metrics["train/tokens"] = float(sum(len(t) for t in batch.input_ids))
    return metrics, times


def _renormalised(batch: TrainBatch, indices: list[int]) -> TrainBatch:
    """A mini-batch with ITS OWN global normalisers (each mini-batch is one optimizer step)."""
    sub = batch.select(indices)
    masks = sub.loss_mask
    return dataclasses.replace(
        sub,
        num_global_tokens=float(sum(float(m.sum()) for m in masks)),
        num_global_seqs=float(sum(1 for m in masks if float(m.sum()) > 0)),
    )


async def run_rl_training(
    backend: Any,
    data_buffer: Any,
    rollout_manager: Any,
    engines: Any,
    config: Config,
    metrics_logger: MetricsLogger,
    *,
    hooks: RLHooks,
    reward_fn: Any = None,
    ref: ReferencePolicy | None = None,
    start_step: int = 0,
    start_version: int = 0,
    loop_state: dict[str, Any] | None = None,
) -> RLResult:
    """Run RL steps `start_step + 1 .. training.rl_steps` (see the module docstring).

    `loop_state` is what the checkpoint hook was given last (a resumed run passes it back).
    """
    schedule = load_schedule(config.algorithm)
    total = config.training.rl_steps
    is_async = config.rollout.mode == "async"
    kl_ctl = AdaptiveKL.from_config(config.algorithm)
    if loop_state and "kl_ctl" in loop_state:
        kl_ctl = kl_ctl.load_state_dict(loop_state["kl_ctl"])
    state = {
        "version": start_version,
        "synced": start_version,
        "trained_through": start_step,  # the last step whose optimizer steps are done
        "checkpointed": start_step,  # the last step with a checkpoint
        "in_backend": False,  # training, or writing a checkpoint: no rescue from there
        "metrics": {},
        "kl_ctl": kl_ctl,
    }
    bound = staleness_bound(
        config.rollout.max_staleness, config.rollout.mode, config.training.sync_every
    )
    engine_sync = EngineSync()
    batches = BatchSource(
        rollout_manager,
        reward_fn,
        data_buffer,
        lambda number: (str(train_version(state, number)), bound),
        engine_sync.wait,
    )
    step = start_step
    async with trio.open_nursery() as nursery:
        if is_async:
            batches.start_producer(nursery, start_step + 1, total)
        overlap = (nursery, engine_sync) if is_async and hooks.publish_weights else None
        for step in range(start_step + 1, total + 1):
            try:
                metrics = await _one_step(
                    step,
                    total,
                    backend,
                    batches,
                    config,
                    hooks,
                    ref,
                    schedule,
                    state,
                    is_async,
                    overlap,
                )
            except Exception as error:
                await _rescue_checkpoint(error, hooks, batches, state)
                raise
            with trio.move_on_after(5.0):  # the engines' load after the batch (0 = no leftovers)
                with contextlib.suppress(EngineError):
                    metrics["engines/load"] = float((await engines.load()).total)
            metrics_logger.log(step, metrics)
            state["metrics"] = metrics
            if hooks.should_stop():
                break
        await engine_sync.finish()  # a delivery still in flight: its error is the run's
        nursery.cancel_scope.cancel()
    return RLResult(steps=step, weight_version=str(state["version"]), last_metrics=state["metrics"])


async def _one_step(
    step: int,
    total: int,
    backend: Any,
    batches: BatchSource,
    config: Config,
    hooks: RLHooks,
    ref: ReferencePolicy | None,
    schedule: Any,
    state: dict[str, Any],
    is_async: bool,
    overlap: tuple[trio.Nursery, EngineSync] | None = None,
) -> dict[str, float]:
    started = time.monotonic()
    rollout, gen_s = await batches.next(step)
    wait_s = time.monotonic() - started
    algo = _with_kl_controller(schedule(step - 1), state["kl_ctl"])
    bound = staleness_bound(
        config.rollout.max_staleness, config.rollout.mode, config.training.sync_every
    )
    prep = prepare_groups(rollout.groups, str(state["version"]), bound)
    metrics = rollout_metrics(prep.groups, rollout.metadata)
    # failed samples of every group the batch saw (a group of FAILED ones is never kept)
    failed = int(rollout.metadata.get("failed_samples", prep.failed_samples))
    metrics |= {
        "rollout/failed_samples": float(failed),
        "rollout/stale_groups_dropped": float(prep.stale_groups),
        "rollout/staleness_max": float(prep.max_staleness_seen),
    }
    times = {"generate": wait_s if is_async else gen_s}
    if is_async:
        metrics["time/generate_overlapped_s"] = gen_s
    state["empty_steps"] = 0 if prep.groups else state.get("empty_steps", 0) + 1
    if state["empty_steps"] >= MAX_EMPTY_STEPS:
        errors = list(rollout.metadata.get("errors", []))[:3]
        raise RuntimeError(
            f"{MAX_EMPTY_STEPS} RL steps in a row had no trainable sample; in the last one "
            f"{failed} sample(s) failed, {prep.stale_groups} group(s) were too "
            f"stale, and the filters dropped {dict(rollout.metadata.get('drop_reasons', {}))} "
            f"(group counts by filter reason); first errors: {errors}"
        )
    if prep.groups:
        state["in_backend"] = True
        train_metrics, train_times = await train_step(backend, prep.groups, algo, config, ref)
        metrics |= train_metrics
        if "train/reward_kl_seq_mean" in train_metrics:  # verl: n_steps = the batch size
            n_seqs = sum(len(g) for g in prep.groups)
            kl_ctl = state["kl_ctl"].update(train_metrics["train/reward_kl_seq_mean"], n_seqs)
            state["kl_ctl"] = kl_ctl
        times |= train_times
        state["version"] += 1
        if ref is not None:
            await ref.update(backend, algo, step)
        state["in_backend"] = False
    state["trained_through"] = step
    state["step_metrics"] = metrics  # what a rescue checkpoint stores if the step fails from here
    if hooks.log_samples is not None:
        hooks.log_samples(step, rollout)
    stopping = hooks.should_stop()
    eval_due = hooks.evaluate is not None and (
        (config.training.eval_every and step % config.training.eval_every == 0) or step == total
    )
    sync_due = step % config.training.sync_every == 0 or step == total or eval_due or stopping
    if sync_due and state["synced"] != state["version"]:
        t = time.monotonic()
        version = str(state["version"])
        if overlap is None:
            metrics |= prefixed(await hooks.sync_weights(version), "sync")
        else:  # the last delivery's figures, then this one's (in the background unless the
            nursery, engine_sync = overlap  # engines must serve it now: eval, stop, the end)
            metrics |= await engine_sync.finish()
            assert hooks.publish_weights is not None
            deliver = await hooks.publish_weights(version)
            if eval_due or stopping or step == total:
                metrics |= prefixed(await deliver(), "sync")
            else:
                engine_sync.start(nursery, deliver)
        state["synced"] = state["version"]
        times["sync"] = time.monotonic() - t
    if eval_due:
        t = time.monotonic()
        if overlap is not None:  # the engines serve the newest weights (no delivery in flight)
            metrics |= await overlap[1].finish()
        metrics |= await hooks.evaluate()
        times["eval"] = time.monotonic() - t
    every = config.checkpoint.every
    if (every and step % every == 0) or step == total or stopping:
        t = time.monotonic()
        resume_state = batches.state_for_resume(step + 1)
        loop_state = {"kl_ctl": state["kl_ctl"].state_dict()}
        state["in_backend"] = True
        await hooks.checkpoint(
            step, str(state["version"]), resume_state, metrics=metrics, loop_state=loop_state
        )
        state["in_backend"] = False
        state["checkpointed"] = step
        times["checkpoint"] = time.monotonic() - t
    return metrics | _timing(times, time.monotonic() - started, rollout, state["version"])


async def _rescue_checkpoint(
    error: Exception, hooks: RLHooks, batches: BatchSource, state: dict[str, Any]
) -> None:
    """Checkpoint the last trained step before `error` stops the run, when it came from outside
    the backend (the engines died, a weight sync or evaluation failed, a reward function raised)
    and that step has no checkpoint yet: the steps since the last periodic checkpoint are kept
    and `--resume` continues after them. The error gets a note saying which step was saved."""
    step = state["trained_through"]
    if state["in_backend"] or step <= state["checkpointed"]:
        return
    try:
        with trio.CancelScope(shield=True):
            await hooks.checkpoint(
                step,
                str(state["version"]),
                batches.state_for_resume(step + 1),
                metrics=state.get("step_metrics", {}),
                loop_state={"kl_ctl": state["kl_ctl"].state_dict()},
            )
    except Exception as failed:
        error.add_note(f"[train] the rescue checkpoint of step {step} failed too: {failed!r}")
        return
    state["checkpointed"] = step
    note = f"[train] step {step} (the last trained one) was checkpointed before the run stopped"
    print(f"{note}; fix the cause below and continue it with --resume", flush=True)
    error.add_note(f"{note}: continue it with --resume")


def _with_kl_controller(algo: AlgorithmConfig, kl_ctl: AdaptiveKL) -> AlgorithmConfig:
    """The step's config with the adaptive controller's coefficient (when it is adaptive)."""
    if kl_ctl.target <= 0.0:
        return algo
    return dataclasses.replace(algo, kl_coef=kl_ctl.coef)


def _timing(
    times: dict[str, float], step_s: float, rollout: RolloutBatch, version: int
) -> dict[str, float]:
    out = {f"time/{k}_s": v for k, v in times.items()}
    out["time/idle_s"] = max(step_s - sum(times.values()), 0.0)
    n_samples = sum(len(g) for g in rollout.groups)
    tokens = float(rollout.metadata.get("generated_tokens", 0))
    out |= {
        "perf/step_time_s": step_s,
        "perf/samples_per_s": n_samples / step_s if step_s > 0 else 0.0,
        "perf/generated_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "perf/compute_fraction": sum(times.get(k, 0.0) for k in ("generate", "logprobs", "train"))
        / step_s
        if step_s > 0
        else 0.0,
        "policy/version": float(version),
    }
    return out
