"""Trajectory rewards from per-step environment signals, computed after collection.

An environment reports, per step, `info["step_reward"]`, `info["success"]` and
`info["invalid_action"]`; the agent loop records the infos in `sample.metadata["env_infos"]`
(one per stepped assistant turn) and the number of assistant turns in `metadata["turns"]`.
A `TrajectoryRewardSpec` weighs them into one reward per step:

    r_k = step_weight * step_reward_k - invalid_penalty * [invalid_k]
          + success_bonus * [k is the first step reporting success]
          + efficiency (last step only): efficiency_bonus * max(0, 1 - turns / max_turns)

The trajectory's reward is sum_k r_k (`trajectory_reward(spec)` is a RewardFn). For per-token
estimators (REINFORCE, GAE), `turn_token_rewards` puts r_k on the last trained token of the k-th
assistant turn (the k-th maximal run of 1s in `loss_mask`), to be passed to
`compute_advantages(..., token_rewards=...)`; its sum over tokens is the trajectory's reward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollouts.envs.protocol import INVALID_ACTION_KEY, STEP_REWARD_KEY, SUCCESS_KEY
from rollouts.types import Sample


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryRewardSpec:
    """Weights of the per-step signals (see the module docstring for the formula)."""

    step_weight: float = 1.0
    success_bonus: float = 1.0
    invalid_penalty: float = 0.1  # subtracted once per step whose action was invalid
    efficiency_bonus: float = 0.0  # times max(0, 1 - turns / max_turns), on the last step
    max_turns: int = 0  # the turn budget efficiency is measured against (needed for the bonus)
    efficiency_needs_success: bool = True  # no bonus for giving up early

    def __post_init__(self) -> None:
        for name in ("step_weight", "success_bonus", "invalid_penalty", "efficiency_bonus"):
            value = getattr(self, name)
            assert math.isfinite(value), f"{name}={value} must be finite"
        assert self.invalid_penalty >= 0.0, f"{self.invalid_penalty=} must be >= 0"
        assert self.efficiency_bonus >= 0.0, f"{self.efficiency_bonus=} must be >= 0"
        assert self.max_turns >= 0, f"{self.max_turns=} must be >= 0"
        assert self.efficiency_bonus == 0.0 or self.max_turns >= 1, (
            f"{self.efficiency_bonus=} needs max_turns >= 1 (got {self.max_turns})"
        )


def _step_reward(info: Mapping[str, Any], k: int) -> float:
    value = info.get(STEP_REWARD_KEY, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"env_infos[{k}][{STEP_REWARD_KEY!r}] = {value!r}: must be a finite number; "
            "fix the environment's step() info"
        )
    return float(value)


def efficiency(turns: int, spec: TrajectoryRewardSpec) -> float:
    """The efficiency bonus for finishing in `turns` assistant turns (0 when switched off)."""
    assert turns >= 0, f"{turns=} must be >= 0"
    if spec.efficiency_bonus == 0.0:
        return 0.0
    return spec.efficiency_bonus * max(0.0, 1.0 - turns / spec.max_turns)


def turn_rewards(
    infos: Sequence[Mapping[str, Any]], turns: int, spec: TrajectoryRewardSpec
) -> list[float]:
    """The reward credited to each environment step, in order (one per stepped turn)."""
    assert turns >= len(infos), f"{turns=} < {len(infos)=}: a step without an assistant turn"
    out: list[float] = []
    succeeded = False
    for k, info in enumerate(infos):
        r = spec.step_weight * _step_reward(info, k)
        if info.get(INVALID_ACTION_KEY, False):
            r -= spec.invalid_penalty
        if info.get(SUCCESS_KEY, False) and not succeeded:
            r += spec.success_bonus
            succeeded = True
        out.append(r)
    if out and (succeeded or not spec.efficiency_needs_success):
        out[-1] += efficiency(turns, spec)
    return out


def infos_and_turns(sample: Sample) -> tuple[list[Mapping[str, Any]], int]:
    """The per-step infos and the assistant-turn count the agent loop recorded."""
    infos = sample.metadata.get("env_infos")
    if infos is None:
        raise ValueError(
            f"sample {sample.index} has no metadata['env_infos']: trajectory rewards need a "
            "multi-turn rollout (set rollout.env, or use rollouts.rollout.generate_multi_turn)"
        )
    turns = int(sample.metadata.get("turns", len(infos)))
    return list(infos), turns


def trajectory_reward_of(sample: Sample, spec: TrajectoryRewardSpec) -> float:
    """The trajectory's reward: the sum of its per-step rewards."""
    infos, turns = infos_and_turns(sample)
    return float(sum(turn_rewards(infos, turns, spec)))


def trajectory_reward(spec: TrajectoryRewardSpec) -> Callable[[Sample], float]:
    """A RewardFn `(sample) -> float` that scores trajectories with `spec`."""

    def reward(sample: Sample) -> float:
        return trajectory_reward_of(sample, spec)

    return reward


def default_trajectory_reward(sample: Sample) -> float:
    """Trajectory reward with the default spec (usable as `rollout.reward_fn` by dotted path)."""
    return trajectory_reward_of(sample, TrajectoryRewardSpec())


def turn_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """`(start, end)` (end exclusive) of each maximal run of trained tokens, in order."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def turn_token_rewards(sample: Sample, spec: TrajectoryRewardSpec) -> torch.Tensor:
    """Per-token rewards [len(tokens)]: step k's reward on the last token of assistant turn k."""
    infos, turns = infos_and_turns(sample)
    rewards = turn_rewards(infos, turns, spec)
    spans = turn_spans(sample.loss_mask)
    if len(rewards) > len(spans):
        raise ValueError(
            f"sample {sample.index}: {len(rewards)} environment steps but {len(spans)} trained "
            "spans in loss_mask; per-turn rewards need one run of trained tokens per turn"
        )
    out = torch.zeros(len(sample.tokens), dtype=torch.float32)
    for r, (_, end) in zip(rewards, spans, strict=False):
        out[end - 1] += r
    return out


def group_turn_token_rewards(
    groups: Sequence[Sequence[Sample]], spec: TrajectoryRewardSpec
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """`turn_token_rewards` of every sample, nested as groups: `token_rewards=` of advantages."""
    return tuple(tuple(turn_token_rewards(s, spec) for s in group) for group in groups)
