"""How much learning signal a batch's groups carry (pure): the figures behind `groups/*`.

GRPO-style advantages are relative to the group: a group whose rewards are all equal (all
wrong, or all right) gets advantage 0 everywhere and teaches nothing. On a hard held-out task
half the groups or more can be like that, and nothing else in the metrics shows it. The manager
records one `GroupSignal` per group that reached a verdict in the batch (kept, or dropped by a
filter such as `check_reward_nonzero_std`, or as surplus); groups saved for a later batch are
counted there, so each group is counted once. The counts travel in the batch's metadata
(`metadata["group_signal"]`) and become the step's `groups/*` and `reward/spread_mean`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from rollouts.rewards.shaping import scored_reward
from rollouts.rollout.filters import reward_vector, rewards_vary
from rollouts.types import Sample

CORRECT = 1.0  # a sample is correct at reward >= 1.0, as `reward/accuracy` counts it
SIGNAL_KEY = "group_signal"  # RolloutBatch.metadata: the counts of `signal_counts`


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupSignal:
    """One scored group, as the learning signal sees it (rewards as scored, before shaping)."""

    all_equal: bool  # no reward varies (the test `check_reward_nonzero_std` drops on)
    all_correct: bool  # every sample correct (too easy: all equal, at the top)
    passed: bool  # at least one sample correct (pass@k with k = the group's size)
    spread: float  # max - min of the group's rewards (a vector reward: its sum)

    def __post_init__(self) -> None:
        assert self.spread >= 0.0, f"{self.spread=} must be >= 0"
        assert not self.all_correct or self.passed, f"{self.all_correct=} but {self.passed=}"


def group_signal(group: Sequence[Sample]) -> GroupSignal | None:
    """The signal of a group whose samples are all scored; None when one is not (a FAILED or
    unfinished sample: such a group is never trained, and says nothing about the task)."""
    rewards = [scored_reward(s) for s in group]
    if not rewards or any(r is None for r in rewards):
        return None
    vectors = [reward_vector(r) for r in rewards]
    totals = [sum(v) for v in vectors]
    correct = [t >= CORRECT for t in totals]
    return GroupSignal(
        all_equal=not rewards_vary(vectors),
        all_correct=all(correct),
        passed=any(correct),
        spread=max(totals) - min(totals),
    )


def signal_counts(signals: Iterable[GroupSignal | None]) -> dict[str, float]:
    """Counts over the groups with a signal (None left out): what the batch metadata carries."""
    seen = [s for s in signals if s is not None]
    return {
        "groups": float(len(seen)),
        "all_equal": float(sum(s.all_equal for s in seen)),
        "all_correct": float(sum(s.all_correct for s in seen)),
        "passed": float(sum(s.passed for s in seen)),
        "spread_sum": sum(s.spread for s in seen),
    }


def signal_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """`groups/*` and `reward/spread_mean` of `signal_counts`; NaN fractions with no group."""
    n = float(counts.get("groups", 0.0))
    assert n >= 0, f"{n=}"

    def frac(key: str) -> float:
        return float(counts.get(key, 0.0)) / n if n else math.nan

    return {
        "groups/seen": n,
        "groups/all_equal_frac": frac("all_equal"),
        "groups/all_correct_frac": frac("all_correct"),
        "groups/pass_at_k": frac("passed"),
        "reward/spread_mean": frac("spread_sum"),
    }
