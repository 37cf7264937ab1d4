"""The metrics that explain learning, on hand-computed values (a numerics guard): the groups
that carry no signal, pass@k, the reward spread, the advantages trained, the samples' times."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.loop.batch import advantage_metrics, rollout_metrics
from rollouts.loop.sft import masked_mean
from rollouts.rollout.filters import check_reward_nonzero_std
from rollouts.rollout.sample_runs import TIMING_KEY, with_timing
from rollouts.rollout.signal import GroupSignal, group_signal, signal_counts, signal_metrics
from rollouts.types import Sample, Status


def _sample(reward: object, status: Status = Status.COMPLETED, **metadata: object) -> Sample:
    return Sample(
        index=0,
        group_index=0,
        prompt="p",
        tokens=(1, 2, 3),
        loss_mask=(0, 1, 1),
        response_length=2,
        reward=reward,  # type: ignore[arg-type]
        status=status,
        metadata=metadata,
    )


def _group(*rewards: object) -> tuple[Sample, ...]:
    return tuple(_sample(r) for r in rewards)


GROUPS = (
    _group(1.0, 1.0, 1.0),  # all equal, all correct (too easy)
    _group(0.0, 0.0, 0.0),  # all equal, none correct (too hard)
    _group(0.0, 0.5, 1.0),  # a signal; one correct; spread 1
    _group((1.0, 0.0), (0.0, 1.0)),  # a vector reward varies (the filter keeps it); both sum to 1
)


def test_each_group_s_signal_by_hand() -> None:
    signals = [group_signal(g) for g in GROUPS]
    assert signals == [
        GroupSignal(all_equal=True, all_correct=True, passed=True, spread=0.0),
        GroupSignal(all_equal=True, all_correct=False, passed=False, spread=0.0),
        GroupSignal(all_equal=False, all_correct=False, passed=True, spread=1.0),
        GroupSignal(all_equal=False, all_correct=True, passed=True, spread=0.0),
    ]
    # all_equal is exactly what check_reward_nonzero_std drops
    assert [s.all_equal for s in signals] == [not check_reward_nonzero_std(g).keep for g in GROUPS]
    assert group_signal(_group(0.7)) == GroupSignal(
        all_equal=True, all_correct=False, passed=False, spread=0.0
    )  # a group of one carries no group-relative signal
    failed = (_sample(1.0), _sample(None, Status.FAILED))
    assert group_signal(failed) is None  # never trained, says nothing about the task
    shaped = _sample(0.25, raw_reward=1.0)  # shaped later: the reward as scored counts
    assert group_signal((shaped, _sample(0.0))) == GroupSignal(
        all_equal=False, all_correct=False, passed=True, spread=1.0
    )


def test_the_counts_and_their_fractions() -> None:
    counts = signal_counts([*(group_signal(g) for g in GROUPS), None])
    assert counts == {
        "groups": 4.0,
        "all_equal": 2.0,
        "all_correct": 2.0,
        "passed": 3.0,
        "spread_sum": 1.0,
    }
    assert signal_metrics(counts) == {
        "groups/seen": 4.0,
        "groups/all_equal_frac": 0.5,
        "groups/all_correct_frac": 0.5,
        "groups/pass_at_k": 0.75,
        "reward/spread_mean": 0.25,
    }
    empty = signal_metrics(signal_counts([]))
    assert empty["groups/seen"] == 0.0 and math.isnan(empty["groups/all_equal_frac"])


def test_rollout_metrics_count_the_groups_a_filter_dropped() -> None:
    """The manager's counts (every group that reached a verdict) win over the kept groups:
    a filter that drops the flat groups would otherwise hide them."""
    kept = [GROUPS[2]]
    counts = signal_counts(group_signal(g) for g in GROUPS)
    seen = rollout_metrics(kept, {"group_signal": counts})
    assert seen["groups/all_equal_frac"] == 0.5 and seen["groups/pass_at_k"] == 0.75
    assert "rollout/group_signal" not in seen  # the counts are not logged raw
    alone = rollout_metrics(kept, {})  # no counts (a batch made elsewhere): the kept groups
    assert alone["groups/all_equal_frac"] == 0.0 and alone["reward/spread_mean"] == 1.0


def test_the_advantages_of_the_trained_tokens() -> None:
    """Trained: 0.5, 0.5, 0.5, -1.0, 0.0 (the 9s and the 7 are masked out): mean 0.1, |A| mean
    0.5, std sqrt((3 * 0.4^2 + 1.1^2 + 0.1^2) / 5) = sqrt(0.34)."""
    advantages = [torch.tensor([9.0, 0.5, 0.5, 0.5]), torch.tensor([9.0, -1.0, 0.0, 7.0])]
    masks = [torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])]
    got = advantage_metrics(advantages, masks)
    assert got == pytest.approx(
        {
            "adv/mean": 0.1,
            "adv/std": math.sqrt(0.34),
            "adv/abs_mean": 0.5,
            "adv/min": -1.0,
            "adv/max": 0.5,
            "adv/zero_frac": 0.2,
        }
    )
    # the same tokens with a sequence of none and a float64 advantage: the same figures
    mixed = [advantages[0].double(), torch.zeros(0), advantages[1]]
    assert advantage_metrics(mixed, [masks[0], torch.zeros(0), masks[1]]) == got
    assert advantage_metrics((), masks[:0]) == {}  # a loss that makes its own advantages
    assert advantage_metrics([torch.zeros(2)], [torch.zeros(2)]) == {}  # no trained token


def test_masked_mean_is_the_token_mean_of_the_trained_tokens() -> None:
    """SFT's held-out accuracy: 3 hits of 4 trained tokens (the untrained hit not counted)."""
    hits = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0])]
    assert masked_mean(hits, masks) == 0.75
    assert math.isnan(masked_mean([torch.ones(2)], [torch.zeros(2)]))


def test_a_sample_s_times_add_up_over_the_batches_that_worked_on_it() -> None:
    s = with_timing(_sample(None), {"queue_s": 0.5, "generate_s": 2.0})
    s = with_timing(s, {"queue_s": 0.25, "generate_s": 1.0, "reward_s": 0.1})  # resumed later
    assert s.metadata[TIMING_KEY] == {"queue_s": 0.75, "generate_s": 3.0, "reward_s": 0.1}
    assert with_timing(s, {}) is s
    rescored = with_timing(s, {"reward_s": 0.2})  # a surplus group scored again, no generation
    assert rescored.metadata[TIMING_KEY] == pytest.approx(
        {"queue_s": 0.75, "generate_s": 3.0, "reward_s": 0.3}
    )
    with pytest.raises(AssertionError, match="negative time"):
        with_timing(s, {"queue_s": -1.0})
