"""Reward shaping (overlong penalty with a soft buffer, efficiency bonus) and the reward pipeline.

`shape_rewards(groups, config)` is what the rollout manager applies to a batch's kept groups, so
a sample leaves the rollout side with its final reward (`[reward]`): vector rewards -> scalar
(Pareto score or weighted sum), absolute or relative (rank) rewards over the group or the batch,
the DAPO overlong penalty, an efficiency bonus, then optional normalisation over the group or the
batch. Every step is a pure function over rewards; the scored reward stays in
`metadata["raw_reward"]` (`scored_reward`).
"""

from __future__ import annotations

from collections.abc import Callable

from rollouts.config import LengthShapingConfig, RewardConfig
from rollouts.rewards.computers import (
    Groups,
    aggregate_vector,
    apply_to_groups,
    compute,
    is_scored,
    normalize,
    replace_reward,
    weighted_sum,
)
from rollouts.types import Reward, Sample


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linear down to -factor at max.

    length <= max - buffer: 0 ; max - buffer < length <= max: ((max - buffer) - length) / buffer
    * factor ; length > max: -factor.
    """
    assert 0 < buffer <= max_length, f"{buffer=} must be in (0, {max_length=}]"
    assert length >= 0, f"{length=} must be >= 0"
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer * factor
    return -factor


def efficiency_bonus(reward: float, length: int, max_length: int, coef: float) -> float:
    """coef * (1 - length / max_length) for a positive reward (shorter right answers earn more)."""
    assert max_length > 0, f"{max_length=} must be > 0"
    if reward <= 0.0:
        return 0.0
    return coef * max(0.0, 1.0 - length / max_length)


def _scalar(config: RewardConfig, user_fn: Callable[[Reward], float] | None):
    def to_scalar(rewards: list[Reward]) -> list[float]:
        if config.transform == "pareto":
            return compute(rewards, "pareto", config.pareto_mode)
        if any(isinstance(r, tuple) for r in rewards):
            weights = config.weights
            fn = user_fn or weighted_sum(weights)
            if user_fn is None and not weights:
                raise ValueError(
                    "vector rewards need reward.weights (a weighted sum), "
                    "reward.transform = 'pareto', or a user aggregation function"
                )
            rewards = list(aggregate_vector(rewards, fn))
        return compute(rewards, config.transform)

    return to_scalar


def _length_terms(config: LengthShapingConfig) -> Callable[[Sample], float]:
    def term(sample: Sample) -> float:
        extra = 0.0
        n, max_len = sample.response_length, config.max_length
        if config.overlong_buffer > 0:
            extra += overlong_penalty(n, max_len, config.overlong_buffer, config.overlong_penalty)
        if config.efficiency_coef > 0:
            extra += efficiency_bonus(float(sample.reward), n, max_len, config.efficiency_coef)
        return extra

    return term


def shape_rewards(
    groups: Groups,
    config: RewardConfig,
    aggregate_fn: Callable[[Reward], float] | None = None,
) -> tuple[tuple[Sample, ...], ...]:
    """The reward pipeline over scored groups (FAILED samples untouched); see the module doc.

    `aggregate_fn` is a user function turning a vector reward into a float (else the weights).
    """
    out = apply_to_groups(groups, _scalar(config, aggregate_fn), config.scope)
    if config.length.enabled:
        term = _length_terms(config.length)
        out = _per_sample(out, lambda s: float(s.reward) + term(s))
    if config.norm != "none":
        out = apply_to_groups(out, lambda rs: normalize([float(r) for r in rs]), config.norm)
    return out


def final_rewards(groups: Groups, config: RewardConfig | None) -> tuple[tuple[Sample, ...], ...]:
    """The groups with their final rewards: `shape_rewards` by `config`, or as scored (None)."""
    if config is None:
        return tuple(tuple(g) for g in groups)
    return shape_rewards(groups, config)


def scored_reward(sample: Sample) -> Reward | None:
    """The reward the reward function gave (before shaping): what the `reward/*` metrics show."""
    raw = sample.metadata.get("raw_reward", sample.reward)
    return tuple(raw) if isinstance(raw, list) else raw  # a checkpointed vector comes back a list


def _per_sample(groups: Groups, fn: Callable[[Sample], float]) -> tuple[tuple[Sample, ...], ...]:
    return tuple(tuple(replace_reward(s, fn(s)) if is_scored(s) else s for s in g) for g in groups)
