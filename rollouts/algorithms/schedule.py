"""Algorithm schedules: `step -> AlgorithmConfig`, so the algorithm can change during training.

`step` is the RL step, 0-based (RL step k gets k - 1), not the optimizer step: one RL step makes
`ppo_epochs` x mini-batches optimizer steps, all with the same config.

`load_schedule(config)` resolves `config.schedule` (a dotted path) through `plugins.load_function`;
with no schedule the config itself is used at every step. `example_schedule` is the built-in
example: GRPO with KL 0.2 until step 30, then KL 0.05, then a DAPO setting from step 60;
`grpo_then_pairwise_schedule` switches from GRPO to the pairwise preference loss at step 20.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from rollouts.config import AlgorithmConfig, KLConfig, PairwiseConfig
from rollouts.plugins import load_function


class ScheduleFn(Protocol):
    """The algorithm config of RL step `step + 1` (0-based; all its optimizer steps use it)."""

    def __call__(self, step: int) -> AlgorithmConfig: ...


def constant_schedule(config: AlgorithmConfig) -> Callable[[int], AlgorithmConfig]:
    """The same config at every step."""

    def schedule(step: int) -> AlgorithmConfig:
        assert step >= 0, f"{step=} must be >= 0"
        return config

    return schedule


def load_schedule(config: AlgorithmConfig) -> Callable[[int], AlgorithmConfig]:
    """The schedule `config.schedule` names, checked; constant when empty.

    A schedule's result is checked at each call: it must be an `AlgorithmConfig` (whose own
    `__post_init__` has already validated it).
    """
    if not config.schedule:
        return constant_schedule(config)
    fn = load_function(config.schedule, ScheduleFn)

    def schedule(step: int) -> AlgorithmConfig:
        out = fn(step)
        if not isinstance(out, AlgorithmConfig):
            raise TypeError(
                f"algorithm.schedule {config.schedule!r} returned {type(out).__name__} at "
                f"{step=}: it must return an AlgorithmConfig"
            )
        return out

    return schedule


def example_schedule(step: int) -> AlgorithmConfig:
    """GRPO, KL-in-loss 0.2 until step 30, then 0.05; from step 60 DAPO (no KL, clip-higher).

    Use it with `algorithm.schedule = "rollouts.algorithms.schedule.example_schedule"`.
    """
    grpo = AlgorithmConfig(
        advantage="grpo", policy_loss="ppo", kl=KLConfig(coef=0.2, estimator="k3")
    )
    if step < 30:
        return grpo
    if step < 60:
        return dataclasses.replace(grpo, kl=KLConfig(coef=0.05, estimator="k3"))
    return AlgorithmConfig(
        advantage="grpo",
        policy_loss="ppo",
        loss_agg="token-mean",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl=KLConfig(coef=0.0),
        entropy_coef=0.0,
    )


def grpo_then_pairwise_schedule(step: int) -> AlgorithmConfig:
    """GRPO (PPO loss) until step 20, then pairwise preference (best vs worst, beta 0.1).

    Pairwise needs the reference model's logprobs: the run builds a reference model whenever a
    schedule is set. Use it with
    `algorithm.schedule = "rollouts.algorithms.schedule.grpo_then_pairwise_schedule"`.
    """
    assert step >= 0, f"{step=} must be >= 0"
    if step < 20:
        return AlgorithmConfig(advantage="grpo", policy_loss="ppo")
    return AlgorithmConfig(
        advantage="grpo",
        policy_loss="pairwise",
        pairwise=PairwiseConfig(beta=0.1, selector="best_vs_worst"),
    )
