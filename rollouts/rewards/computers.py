"""Reward computers applied to a group or a batch after collection.

absolute (as scored), relative (rank-normalised within the group or the batch), pareto (vector
rewards: Pareto ranks, frontier membership, distance to the frontier), vector aggregation
(weighted sum or a user function), and normalisation. The list functions are pure over rewards;
`apply_to_groups` maps one over Samples (FAILED ones skipped) with `dataclasses.replace`, keeping
the reward it replaced in `metadata["raw_reward"]`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Sequence

from rollouts.config import ParetoMode, RewardScope, RewardTransform
from rollouts.types import Reward, Sample, Status

Groups = Sequence[Sequence[Sample]]
Points = Sequence[Sequence[float]]


def rank_normalize(values: Sequence[float]) -> list[float]:
    """Ranks scaled to [0, 1] (lowest 0, highest 1), ties share their average rank; one -> 0.5."""
    n = len(values)
    if n == 1:
        return [0.5]
    order = sorted(range(n), key=lambda i: values[i])
    ranks = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2
        start = end + 1
    return [r / (n - 1) for r in ranks]


def normalize(values: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(v - mean) / (std + eps) with the unbiased std (as GRPO); one value -> 0."""
    n = len(values)
    if n == 0:
        return []
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return [(v - mean) / (std + eps) for v in values]


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """a Pareto-dominates b (every objective maximised): a >= b everywhere, > somewhere."""
    assert len(a) == len(b), f"{len(a)=} != {len(b)=}"
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(
        x > y for x, y in zip(a, b, strict=True)
    )


def pareto_ranks(points: Points) -> list[int]:
    """Non-dominated sorting: rank 0 is the frontier, rank 1 the frontier of the rest, ..."""
    left = set(range(len(points)))
    ranks = [0] * len(points)
    rank = 0
    while left:
        front = {i for i in left if not any(dominates(points[j], points[i]) for j in left)}
        assert front, "non-dominated sorting made no progress"
        for i in front:
            ranks[i] = rank
        left -= front
        rank += 1
    return ranks


def on_frontier(points: Points) -> list[bool]:
    """Which points no other point dominates."""
    return [r == 0 for r in pareto_ranks(points)]


def distance_to_frontier(points: Points) -> list[float]:
    """Euclidean distance from each point to the nearest frontier point (0 on the frontier)."""
    front = [p for p, f in zip(points, on_frontier(points), strict=True) if f]
    return [min(math.dist(p, q) for q in front) for p in points]


def pareto_scores(points: Points, mode: ParetoMode = "rank") -> list[float]:
    """A scalar per point: "rank" -> 1 / (1 + Pareto rank); "distance" -> -distance to frontier."""
    assert mode in typing.get_args(ParetoMode), f"{mode=} not in {typing.get_args(ParetoMode)}"
    if mode == "rank":
        return [1.0 / (1 + r) for r in pareto_ranks(points)]
    return [-d for d in distance_to_frontier(points)]


def weighted_sum(weights: Sequence[float]) -> Callable[[Reward], float]:
    """Aggregate a vector reward as sum_k w_k r_k (a float reward passes through)."""

    def aggregate(reward: Reward) -> float:
        if not isinstance(reward, tuple):
            return float(reward)
        if len(reward) != len(weights):
            raise ValueError(
                f"vector reward has {len(reward)} objectives but {len(weights)} weights were "
                "given (reward.weights)"
            )
        return float(sum(w * r for w, r in zip(weights, reward, strict=True)))

    return aggregate


def aggregate_vector(rewards: Sequence[Reward], fn: Callable[[Reward], float]) -> list[float]:
    """Each reward through `fn` (e.g. `weighted_sum(weights)` or a user function)."""
    return [float(fn(r)) for r in rewards]


def _points(rewards: Sequence[Reward]) -> list[tuple[float, ...]]:
    return [r if isinstance(r, tuple) else (float(r),) for r in rewards]


def compute(
    rewards: Sequence[Reward], kind: RewardTransform, pareto_mode: ParetoMode = "rank"
) -> list[float]:
    """One reward computer over a list of rewards: absolute | relative | pareto."""
    if kind == "pareto":
        return pareto_scores(_points(rewards), pareto_mode)
    floats = []
    for r in rewards:
        if isinstance(r, tuple):
            raise ValueError(f"reward {r} is a vector: aggregate it first or use 'pareto'")
        floats.append(float(r))
    if kind == "relative":
        return rank_normalize(floats)
    assert kind == "absolute", f"{kind=} must be absolute, relative or pareto"
    return floats


def apply_to_groups(
    groups: Groups, fn: Callable[[list[Reward]], list[float]], scope: RewardScope = "group"
) -> tuple[tuple[Sample, ...], ...]:
    """Replace the rewards of scored samples by `fn` over each group, or over the whole batch.

    FAILED samples and samples without a reward are left as they are (never given a reward).
    """
    assert scope in typing.get_args(RewardScope), f"{scope=} not in {typing.get_args(RewardScope)}"
    scored = [[i for i, s in enumerate(g) if is_scored(s)] for g in groups]
    chunks = [[(g, i) for i in idx] for g, idx in enumerate(scored)]
    if scope == "batch":
        chunks = [[gi for chunk in chunks for gi in chunk]]
    new: dict[tuple[int, int], float] = {}
    for chunk in chunks:
        if chunk:
            values = fn([groups[g][i].reward for g, i in chunk])
            assert len(values) == len(chunk), f"{len(values)=} != {len(chunk)=}"
            new.update(zip(chunk, values, strict=True))
    return tuple(
        tuple(replace_reward(s, new[(g, i)]) if (g, i) in new else s for i, s in enumerate(group))
        for g, group in enumerate(groups)
    )


def is_scored(sample: Sample) -> bool:
    """A sample with a reward that is not FAILED (what reward computers act on)."""
    return sample.status is not Status.FAILED and sample.reward is not None


def replace_reward(sample: Sample, reward: float) -> Sample:
    """The sample with a new reward; the first reward it had is kept in metadata["raw_reward"]."""
    meta = dict(sample.metadata)
    meta.setdefault("raw_reward", sample.reward)
    return dataclasses.replace(sample, reward=float(reward), metadata=meta)
