"""One RL training step on a batch of groups: advantages, logprobs, then `ppo_epochs` x
mini-batch optimizer updates. The reference policy the KL terms compare against is
`trainer/reference.py`.

Nothing here knows where the batch came from or what happens after the update: the loop
(`rl.py`) calls `train_step` once per step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rollouts import tracing
from rollouts.algorithms.algorithm import Algorithm
from rollouts.algorithms.kl import kl_reward_penalties, sequence_mean_kl
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.algorithms.pairwise import groups_of
from rollouts.algorithms.tensors import row_sums
from rollouts.config import AlgorithmConfig, Config
from rollouts.gcpolicy import gc_paused
from rollouts.loop.batch import (
    advantage_metrics,
    epoch_metrics,
    mini_batches,
    prefixed,
    train_batch_of,
    value_input_batch,
)
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.reference import ReferencePolicy
from rollouts.types import TrainBatch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one training step gives the loop: its metrics and phase times, and with the KL in
    the reward the batch's sequence-mean KL (what the adaptive KL controller follows)."""

    metrics: dict[str, float]
    times: dict[str, float]
    reward_kl: float | None = None  # None: the KL is not in the reward (no controller input)
    batch: TrainBatch | None = None  # the batch as trained (`logging.save_batches` stores it)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Prepared:
    """A step's batch before the updates, and the algorithm it trains with."""

    batch: TrainBatch
    algorithm: Algorithm
    extra: dict[str, float]  # metrics of the preparation (the KL in the reward)
    times: dict[str, float]
    reward_kl: float | None = None


async def _logprobs_for(
    batch: TrainBatch,
    backend: TrainingBackend,
    ref: ReferencePolicy | None,
    algorithm: Algorithm,
    separate_old: bool,
) -> tuple[TrainBatch, float]:
    """Old logprobs when a separate pass is needed (`Algorithm.needs_old_logprobs_pass`) and
    reference logprobs. Without old logprobs the loss takes them from the training forward
    (ratio = 1), and the engine/trainer mismatch and TIS too."""
    started = time.monotonic()
    if separate_old:
        old = await backend.compute_logprobs(batch)
        batch = dataclasses.replace(batch, old_logprobs=tuple(old))
    if algorithm.needs_reference:
        if ref is None:
            raise ValueError(
                f"algorithm.policy_loss = {algorithm.config.policy_loss!r} with kl.coef = "
                f"{algorithm.config.kl.coef} needs a reference model (none was built)"
            )
        batch = dataclasses.replace(batch, ref_logprobs=tuple(await ref.logprobs(batch)))
    return batch, time.monotonic() - started


async def _critic_values(
    backend: TrainingBackend, groups: Any, algorithm: Algorithm
) -> tuple[Any, ...] | None:
    """The critic's values before the update (GAE needs them); None for other estimators."""
    if not algorithm.needs_critic:
        return None
    return tuple(await backend.compute_values(value_input_batch(groups)))


async def _kl_in_reward_batch(
    groups: Any,
    algo: AlgorithmConfig,
    config: Config,
    backend: TrainingBackend,
    ref: ReferencePolicy,
    values: tuple[Any, ...] | None = None,
) -> tuple[TrainBatch, dict[str, float], float]:
    """KL in the reward: per-token penalties from old vs reference logprobs, then advantages;
    (the batch, its metrics, its sequence-mean KL)."""
    max_new = config.rollout.sampling.max_new_tokens
    plain = train_batch_of(groups, algo, max_new_tokens=max_new, values=values)
    old = await backend.compute_logprobs(plain)
    ref_lp = await ref.logprobs(plain)
    penalties, batch_kl = kl_reward_penalties(old, ref_lp, plain.loss_mask, algo.kl, algo.kl.coef)
    batch = train_batch_of(
        groups, algo, max_new_tokens=max_new, kl_penalties=penalties, values=values
    )
    batch = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=tuple(ref_lp))
    seq_kl = sequence_mean_kl(old, ref_lp, plain.loss_mask, algo.kl)
    metrics = {
        "train/reward_kl": batch_kl,
        "train/reward_kl_seq_mean": seq_kl,
        "train/kl_coef": algo.kl.coef,
    }
    return batch, metrics, seq_kl


async def _batch_with_logprobs(
    backend: TrainingBackend,
    groups: Any,
    algorithm: Algorithm,
    config: Config,
    ref: ReferencePolicy | None,
) -> _Prepared:
    """The step's batch (advantages, old and reference logprobs as needed), the algorithm it
    trains with (KL in the reward: none left for the loss), its extra metrics and times."""
    times: dict[str, float] = {}
    started = time.monotonic()
    values = await _critic_values(backend, groups, algorithm)
    if values is not None:
        times["values"] = tracing.phase("values", time.monotonic() - started, start_s=started)
    if algorithm.kl_in_reward and ref is not None:
        started = time.monotonic()
        algo = algorithm.config
        batch, extra, kl = await _kl_in_reward_batch(groups, algo, config, backend, ref, values)
        times["logprobs"] = tracing.phase("logprobs", time.monotonic() - started, start_s=started)
        # the KL is in the reward, not the loss (the controller, if any, already steered it)
        applied = algorithm.with_kl_in_reward_applied()
        return _Prepared(batch=batch, algorithm=applied, extra=extra, times=times, reward_kl=kl)
    max_new = config.rollout.sampling.max_new_tokens
    with gc_paused():  # a view per sample and field: the step's (acyclic) batch
        batch = train_batch_of(groups, algorithm.config, max_new_tokens=max_new, values=values)
    n_mini = len(mini_batches(groups, algorithm.config.mini_batch_size))
    separate = algorithm.needs_old_logprobs_pass(n_mini)
    batch, seconds = await _logprobs_for(batch, backend, ref, algorithm, separate)
    times["logprobs"] = tracing.phase("logprobs", seconds)
    return _Prepared(batch=batch, algorithm=algorithm, extra={}, times=times)


async def train_step(
    backend: TrainingBackend,
    groups: Any,
    algo: AlgorithmConfig,
    config: Config,
    ref: ReferencePolicy | None,
) -> StepResult:
    """Advantages, logprobs and `ppo_epochs` x mini-batch optimizer steps."""
    prepared = await _batch_with_logprobs(backend, groups, Algorithm(config=algo), config, ref)
    batch, algorithm, times = prepared.batch, prepared.algorithm, prepared.times
    algo = algorithm.config
    loss_fn = make_loss_fn(algo)
    started = time.monotonic()
    summed: dict[str, float] = {}
    per_epoch: list[dict[str, float]] = []
    n_updates = 0
    for _ in range(algo.ppo_epochs):
        per_epoch.append({"_n": 0.0})
        for indices in mini_batches(groups, algo.mini_batch_size):
            with gc_paused():
                mb = batch if len(indices) == len(batch) else _renormalised(batch, indices)
                mb = algorithm.prepare(mb, groups_of(groups, indices))  # (pairwise: its pairs)
            fb = await backend.forward_backward(mb, loss_fn, entropy=True)
            opt = await backend.optim_step()
            for key, value in {**fb, **opt}.items():
                summed[key] = summed.get(key, 0.0) + float(value)
                per_epoch[-1][key] = per_epoch[-1].get(key, 0.0) + float(value)
            per_epoch[-1]["_n"] += 1.0
            n_updates += 1
    seconds = time.monotonic() - started
    times["train"] = tracing.phase("train", seconds, start_s=started, updates=n_updates)
    metrics = {k: v / n_updates for k, v in summed.items()}  # mean over optimizer updates
    metrics = prefixed(metrics, "train") | prepared.extra
    if algo.ppo_epochs > 1 or algorithm.needs_critic:
        metrics |= epoch_metrics(per_epoch)
    metrics["train/updates"] = float(n_updates)
    metrics["train/tokens"] = float(sum(len(t) for t in batch.input_ids))
    metrics |= advantage_metrics(batch.advantages, batch.loss_mask)  # adv/*: what was trained
    return StepResult(metrics=metrics, times=times, reward_kl=prepared.reward_kl, batch=batch)


def _renormalised(batch: TrainBatch, indices: list[int]) -> TrainBatch:
    """A mini-batch with ITS OWN global normalisers (each mini-batch is one optimizer step)."""
    sub = batch.select(indices)
    sums = row_sums(sub.loss_mask)  # one segmented reduction, not two per sequence
    return dataclasses.replace(
        sub,
        num_global_tokens=float(sum(sums)),
        num_global_seqs=float(sum(1 for n in sums if n > 0)),
    )
