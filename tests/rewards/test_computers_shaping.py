"""Reward computers (relative, pareto, vector, normalisation) and shaping, by hand."""

from __future__ import annotations

import json
import math

import pytest

from rollouts.config import ConfigError, LengthShapingConfig, RewardConfig
from rollouts.loop.batch import rollout_metrics
from rollouts.rewards.computers import (
    apply_to_groups,
    compute,
    distance_to_frontier,
    normalize,
    on_frontier,
    pareto_ranks,
    pareto_scores,
    rank_normalize,
    weighted_sum,
)
from rollouts.rewards.shaping import (
    efficiency_bonus,
    final_rewards,
    overlong_penalty,
    shape_rewards,
)
from rollouts.types import Sample, Status, sample_from_dict, sample_to_dict


def scored(reward, group=0, length=4, status=Status.COMPLETED) -> Sample:
    return Sample(
        index=0,
        group_index=group,
        prompt="p",
        tokens=(0,) * (length + 1),
        loss_mask=(0,) + (1,) * length,
        response_length=length,
        reward=reward,
        status=status,
    )


def test_rank_normalize_with_ties():
    # sorted 1, 3, 3, 9 -> ranks 0, 1.5, 1.5, 3 -> / 3
    assert rank_normalize([3.0, 1.0, 9.0, 3.0]) == [0.5, 0.0, 1.0, 0.5]
    assert rank_normalize([7.0]) == [0.5]
    assert rank_normalize([2.0, 2.0]) == [0.5, 0.5]


def test_normalize_unbiased():
    # mean 2, unbiased std 1 -> (-1, 0, 1) / (1 + 1e-6)
    assert normalize([1.0, 2.0, 3.0]) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    assert normalize([5.0]) == [0.0]


def test_pareto():
    pts = [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.4, 0.4), (0.0, 0.0)]
    # (.4,.4) dominated by (.5,.5) only; (0,0) dominated by all -> ranks 0,0,0,1,2
    assert pareto_ranks(pts) == [0, 0, 0, 1, 2]
    assert on_frontier(pts) == [True, True, True, False, False]
    # nearest frontier point of (.4,.4) is (.5,.5): sqrt(.02); of (0,0): (.5,.5) -> sqrt(.5)
    dist = distance_to_frontier(pts)
    assert dist == pytest.approx([0, 0, 0, math.sqrt(0.02), math.sqrt(0.5)])
    assert pareto_scores(pts) == pytest.approx([1, 1, 1, 0.5, 1 / 3])
    assert pareto_scores(pts, "distance")[4] == pytest.approx(-math.sqrt(0.5))
    # equal points do not dominate each other
    assert pareto_ranks([(1.0, 1.0), (1.0, 1.0)]) == [0, 0]


def test_vector_aggregation():
    agg = weighted_sum([0.5, 2.0])
    assert agg((1.0, 3.0)) == 6.5  # .5 * 1 + 2 * 3
    assert agg(4.0) == 4.0
    with pytest.raises(ValueError, match="2 weights"):
        agg((1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="vector"):
        compute([(1.0, 2.0)], "relative")


def test_apply_to_groups_scope_and_failed_untouched():
    failed = scored(None, status=Status.FAILED)
    groups = [[scored(1.0), scored(3.0), failed], [scored(2.0, group=1)]]
    by_group = apply_to_groups(groups, rank_normalize, "group")
    assert [s.reward for s in by_group[0]] == [0.0, 1.0, None]
    assert by_group[0][2] is failed
    assert by_group[1][0].reward == 0.5  # alone in its group
    assert by_group[0][1].metadata["raw_reward"] == 3.0
    by_batch = apply_to_groups(groups, rank_normalize, "batch")
    # batch 1, 3, 2 -> ranks 0, 2, 1 -> / 2
    assert [by_batch[0][0].reward, by_batch[0][1].reward, by_batch[1][0].reward] == [0, 1, 0.5]


def test_overlong_penalty_soft_buffer():
    # max 10, buffer 4: free up to 6; 8 -> (6 - 8)/4 = -.5; 10 -> -1; 12 -> -1 (times factor)
    assert overlong_penalty(6, 10, 4) == 0.0
    assert overlong_penalty(8, 10, 4) == -0.5
    assert overlong_penalty(10, 10, 4, factor=2.0) == -2.0
    assert overlong_penalty(12, 10, 4) == -1.0


def test_efficiency_bonus():
    # .2 * (1 - 25/100) = .15 ; wrong answers earn nothing
    assert efficiency_bonus(1.0, 25, 100, 0.2) == pytest.approx(0.15)
    assert efficiency_bonus(0.0, 25, 100, 0.2) == 0.0


def test_shape_rewards_pipeline():
    groups = [[scored((1.0, 0.0), length=8), scored((0.0, 1.0), length=2)]]
    length = LengthShapingConfig(overlong_buffer=4, max_length=10)
    config = RewardConfig(weights=[1.0, 0.5], length=length)
    out = shape_rewards(groups, config)
    # weighted: 1.0 and .5 ; overlong: length 8 -> -.5, length 2 -> 0 -> .5, .5
    assert [s.reward for s in out[0]] == [0.5, 0.5]
    assert out[0][0].metadata["raw_reward"] == (1.0, 0.0)
    norm = shape_rewards([[scored(1.0), scored(0.0)]], RewardConfig(norm="group"))
    w = 0.5 / (math.sqrt(0.5) + 1e-6)  # mean .5, unbiased std sqrt(.5)
    assert [s.reward for s in norm[0]] == pytest.approx([w, -w])
    pareto = shape_rewards(groups, RewardConfig(transform="pareto"))
    assert [s.reward for s in pareto[0]] == [1.0, 1.0]  # both on the frontier
    with pytest.raises(ValueError, match="reward.weights"):
        shape_rewards(groups, RewardConfig())
    user = shape_rewards(groups, RewardConfig(), aggregate_fn=lambda r: max(r))
    assert [s.reward for s in user[0]] == [1.0, 1.0]
    with pytest.raises(ConfigError, match="reward.length.max_length"):
        LengthShapingConfig(overlong_buffer=4)


def test_reward_metrics_are_of_the_scored_rewards():
    """The `reward/*` metrics report the rewards as scored, before shaping (as they always
    did), also for a sample back from a checkpoint (its raw vector reward a JSON list)."""
    groups = [[scored((1.0, 0.0)), scored((0.0, 1.0))], [scored((1.0, 1.0)), scored((0.0, 0.0))]]
    shaped = shape_rewards(groups, RewardConfig(weights=[1.0, 0.5], norm="batch"))
    assert [s.reward for g in shaped for s in g] != [sum(s.reward) for g in groups for s in g]
    back = [
        [sample_from_dict(json.loads(json.dumps(sample_to_dict(s)))) for s in g] for g in shaped
    ]
    before = rollout_metrics(groups, {})
    for after in (rollout_metrics(shaped, {}), rollout_metrics(back, {})):
        for key in ("reward/mean", "reward/std", "reward/accuracy"):
            assert after[key] == before[key], key
    assert final_rewards(groups, None) == tuple(tuple(g) for g in groups)
