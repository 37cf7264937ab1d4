"""Group filters (dynamic sampling): keep a scored group, or drop it with a reason.

Each filter is a pure function of the group. A vector reward counts as varying when any of its
components varies; the quality checks use the first component. Dropped groups are counted by
reason in the batch metadata, and the manager samples more groups to replace them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rollouts.plugins import import_object
from rollouts.rollout.protocol import FilterResult, GroupFilter
from rollouts.types import Reward, Sample, Status

KEEP = FilterResult(keep=True)


def reward_vector(reward: Reward | None) -> tuple[float, ...]:
    """A reward as a tuple of floats (a scalar becomes a 1-tuple)."""
    assert reward is not None, "a filter got an unscored sample"
    return tuple(reward) if isinstance(reward, tuple) else (float(reward),)


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def rewards_vary(vectors: Sequence[tuple[float, ...]], eps: float = 1e-6) -> bool:
    """Whether a group's rewards differ: more than one, and some component's std above eps."""
    return len(vectors) > 1 and any(_std(column) > eps for column in zip(*vectors, strict=True))


def check_reward_nonzero_std(group: Sequence[Sample], eps: float = 1e-6) -> FilterResult:
    """Drop groups whose rewards are all equal: they carry no group-relative signal."""
    if rewards_vary([reward_vector(s.reward) for s in group], eps):
        return KEEP
    return FilterResult(keep=False, reason="zero_reward_std")


def check_min_reward(group: Sequence[Sample], min_reward: float = 0.0) -> FilterResult:
    """Drop groups whose mean reward (first component) is below `min_reward`."""
    mean = sum(reward_vector(s.reward)[0] for s in group) / len(group)
    return KEEP if mean >= min_reward else FilterResult(keep=False, reason="low_reward")


def check_response_diversity(
    group: Sequence[Sample], min_unique_fraction: float = 0.5
) -> FilterResult:
    """Drop groups where too few responses differ (token for token)."""
    unique = len({s.response_tokens for s in group})
    if unique / len(group) >= min_unique_fraction:
        return KEEP
    return FilterResult(keep=False, reason="low_diversity")


def check_reasonable_length(
    group: Sequence[Sample], min_tokens: int = 1, max_truncated_fraction: float = 0.5
) -> FilterResult:
    """Drop groups with an empty-ish response or too many responses cut at the length limit."""
    if any(s.response_length < min_tokens for s in group):
        return FilterResult(keep=False, reason="too_short")
    truncated = sum(s.status is Status.TRUNCATED for s in group)
    if truncated / len(group) > max_truncated_fraction:
        return FilterResult(keep=False, reason="too_many_truncated")
    return KEEP


def check_quality_and_diversity(group: Sequence[Sample]) -> FilterResult:
    """Reward varies, mean reward >= 0, and at least half the responses differ."""
    for check in (check_reward_nonzero_std, check_min_reward, check_response_diversity):
        result = check(group)
        if not result.keep:
            return result
    return KEEP


def builtin_filters() -> dict[str, Callable[[Sequence[Sample]], FilterResult]]:
    """Filters available by name in `rollout.filters`."""
    return {
        f.__name__: f
        for f in (
            check_reward_nonzero_std,
            check_min_reward,
            check_response_diversity,
            check_reasonable_length,
            check_quality_and_diversity,
        )
    }


def resolve_filters(specs: Sequence[str | GroupFilter]) -> list[GroupFilter]:
    """Built-in names, dotted paths or callables, in order."""
    names = builtin_filters()
    out: list[GroupFilter] = []
    for spec in specs:
        if callable(spec):
            out.append(spec)
        elif spec in names:
            out.append(names[spec])
        else:
            fn = import_object(spec)
            if not callable(fn):
                raise ValueError(
                    f"rollout.filters: {spec!r} is not callable; built-ins: {sorted(names)}"
                )
            out.append(fn)
    return out


def run_filters(group: Sequence[Sample], filters: Sequence[GroupFilter]) -> FilterResult:
    """The first drop among `filters` (a bool False is named after the filter), else keep.

    A group holding a FAILED sample is dropped first ("failed"), then one holding a sample that
    did not finish ("unfinished"): neither may be trained on.
    """
    assert group, "cannot filter an empty group"
    if any(s.status is Status.FAILED for s in group):
        return FilterResult(keep=False, reason="failed")
    if any(s.status not in (Status.COMPLETED, Status.TRUNCATED) for s in group):
        return FilterResult(keep=False, reason="unfinished")
    for f in filters:
        result = f(group)
        if isinstance(result, bool):
            name = getattr(f, "__name__", None) or getattr(
                getattr(f, "func", None), "__name__", type(f).__name__
            )
            result = KEEP if result else FilterResult(keep=False, reason=name)
        assert isinstance(result, FilterResult), f"filter {f!r} returned {result!r}"
        if not result.keep:
            return result
    return KEEP
