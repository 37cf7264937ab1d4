"""Advantage estimators pinned to hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.algorithms.advantages import (
    compute_advantages,
    compute_gae,
    discounted_returns,
    gae,
    grpo_scores,
    last_trained,
    outcome_token_rewards,
    rloo_scores,
)
from rollouts.config import AlgorithmConfig
from rollouts.types import Sample, Status


def sample(reward, mask=(0, 0, 1, 1), group=0, index=0) -> Sample:
    n = len(mask)
    return Sample(
        index=index,
        group_index=group,
        prompt="p",
        tokens=tuple(range(10, 10 + n)),
        loss_mask=tuple(mask),
        response_length=n - 2,
        reward=reward,
        status=Status.COMPLETED,
    )


def values_of(out) -> list[list[float]]:
    return [[round(float(a[-1]), 6) for a in row] for row in out]


def test_grpo_with_std_unbiased():
    # rewards 1,2,3: mean 2, unbiased std sqrt((1+0+1)/2) = 1 -> A = (-1, 0, 1) / (1 + 1e-6)
    a = grpo_scores(torch.tensor([1.0, 2.0, 3.0]))
    assert a.tolist() == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)], abs=1e-7)
    # rewards 1,0,0,1: mean 0.5, std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> A = +-0.5 / (sqrt(1/3)+1e-6)
    a = grpo_scores(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.866023...
    assert a.tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)


def test_grpo_edge_cases():
    # all equal: std 0 -> (s - mean) / (0 + eps) = 0
    assert grpo_scores(torch.tensor([0.5, 0.5, 0.5])).tolist() == [0.0, 0.0, 0.0]
    # group of one: mean 0, std 1 -> 1 / (1 + 1e-6); without std: 1 - 0 = 1
    assert grpo_scores(torch.tensor([1.0])).item() == pytest.approx(1 / (1 + 1e-6), abs=1e-7)
    assert grpo_scores(torch.tensor([1.0]), norm_by_std=False).item() == 1.0
    # Dr.GRPO: 1,2,3 - 2 = -1, 0, 1
    assert grpo_scores(torch.tensor([1.0, 2.0, 3.0]), False).tolist() == [-1.0, 0.0, 1.0]


def test_rloo():
    # A_i = s_i - mean(others): 1 - (2+3)/2 = -1.5 ; 2 - (1+3)/2 = 0 ; 3 - (1+2)/2 = 1.5
    assert rloo_scores(torch.tensor([1.0, 2.0, 3.0])).tolist() == [-1.5, 0.0, 1.5]
    assert rloo_scores(torch.tensor([4.0])).tolist() == [4.0]  # group of one: no baseline


def test_compute_advantages_broadcasts_over_trained_tokens():
    groups = [[sample(1.0), sample(2.0), sample(3.0, mask=(0, 0, 0, 1))], [sample(5.0)]]
    out = compute_advantages(groups, AlgorithmConfig(advantage="dr_grpo"))
    # group 0: 1,2,3 - 2 ; group 1: a group of one keeps 5 - 0
    assert out[0][0].tolist() == [0.0, 0.0, -1.0, -1.0]
    assert out[0][1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out[0][2].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert out[1][0].tolist() == [0.0, 0.0, 5.0, 5.0]
    rloo = compute_advantages(groups, AlgorithmConfig(advantage="rloo"))
    assert values_of(rloo) == [[-1.5, 0.0, 1.5], [5.0]]


def test_all_masked_row_gets_zero_advantage():
    groups = [[sample(1.0, mask=(0, 0, 0, 0)), sample(0.0)]]
    out = compute_advantages(groups, AlgorithmConfig(advantage="grpo"))
    # the all-masked sample has no trained token: its reward is never placed, so its score is 0;
    # scores (0, 0) are equal -> both advantages 0
    assert out[0][0].tolist() == [0.0] * 4
    assert out[0][1].tolist() == [0.0] * 4


def test_kl_penalties_enter_the_sequence_score():
    groups = [[sample(1.0), sample(0.0)]]
    pen = ((torch.tensor([9.0, 9.0, 0.1, 0.2]), torch.zeros(4)),)
    rewards = outcome_token_rewards(groups, pen)
    # untrained positions ignore the penalty; trained: -0.1, 1 - 0.2 = 0.8
    assert rewards[0][0].tolist() == pytest.approx([0.0, 0.0, -0.1, 0.8])
    out = compute_advantages(groups, AlgorithmConfig(advantage="dr_grpo"), token_rewards=rewards)
    # scores 0.7 and 0 -> mean 0.35 -> +-0.35
    assert values_of(out) == [[0.35, -0.35]]


def test_reinforce_discounts_over_trained_tokens_only():
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])  # position 3 is an observation token
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    # G4 = 1 ; G2 = 0 + 0.5 * G4 = 0.5 (obs skipped) ; G1 = 0.5 * 0.5 = 0.25
    assert discounted_returns(rewards, mask, 0.5).tolist() == [0.0, 0.25, 0.5, 0.0, 1.0]
    groups = [[sample(1.0, mask=(0, 1, 1, 0, 1))]]
    out = compute_advantages(groups, AlgorithmConfig(advantage="reinforce", gamma=0.5))
    assert out[0][0].tolist() == [0.0, 0.25, 0.5, 0.0, 1.0]


def test_reinforce_pp_baseline_and_batch_whitening():
    groups = [[sample(1.0), sample(0.0)]]
    out = compute_advantages(groups, AlgorithmConfig(advantage="reinforce_pp"))
    # scores - group mean = +0.5, -0.5; reward-to-go (gamma 1) on 2 tokens each: 0.5,0.5,-0.5,-0.5
    # whiten over the 4 tokens: mean 0, unbiased var 4*0.25/3 = 1/3 -> +-0.5/sqrt(1/3 + 1e-8)
    w = 0.5 / math.sqrt(1 / 3 + 1e-8)  # 0.866025
    assert out[0][0].tolist() == pytest.approx([0.0, 0.0, w, w], abs=1e-6)
    assert out[0][1].tolist() == pytest.approx([0.0, 0.0, -w, -w], abs=1e-6)


def test_reinforce_pp_group_of_one_keeps_its_score():
    # defect: with n_samples_per_prompt = 1 the group mean was the sample's own score -> all 0.
    # verl's REINFORCE++-baseline: a group of one has mean 0, so the batch whitening decides.
    groups = [[sample(1.0, group=0)], [sample(0.0, group=1)]]
    for name in ("reinforce_pp", "reinforce_plus_plus_baseline"):
        out = compute_advantages(groups, AlgorithmConfig(advantage=name))
        # scores 1 and 0 (mean 0 each) -> tokens 1,1,0,0 -> whitened: mean .5, var 1/3
        w = 0.5 / math.sqrt(1 / 3 + 1e-8)
        assert out[0][0].tolist() == pytest.approx([0.0, 0.0, w, w], abs=1e-6)
        assert out[1][0].tolist() == pytest.approx([0.0, 0.0, -w, -w], abs=1e-6)


def test_reinforce_plus_plus_whitens_discounted_returns_without_baseline():
    # verl compute_reinforce_plus_plus_outcome_advantage: returns with gamma, masked_whiten over
    # the batch, no group mean. One group of two: scores 1 and 1 (a baseline would give 0).
    groups = [[sample(1.0, mask=(0, 1, 1)), sample(1.0, mask=(0, 1, 1), index=1)]]
    out = compute_advantages(groups, AlgorithmConfig(advantage="reinforce_plus_plus", gamma=0.5))
    # returns per sample: t1 = 0.5, t2 = 1.0 -> over 4 tokens mean .75, unbiased var
    # (4 * .0625) / 3 = 1/12 -> (.5 - .75) / sqrt(1/12 + 1e-8) = -0.866025, +0.866025
    w = 0.25 / math.sqrt(1 / 12 + 1e-8)
    for row in out[0]:
        assert row.tolist() == pytest.approx([0.0, -w, w], abs=1e-6)
    baseline = compute_advantages(groups, AlgorithmConfig(advantage="reinforce_pp", gamma=0.5))
    assert baseline[0][0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_gae_hand_values():
    r = torch.tensor([0.0, 0.0, 1.0])
    v = torch.tensor([0.5, 0.5, 0.5])
    m = torch.ones(3)
    # gamma = lam = 1: delta2 = 1 - .5 = .5; delta1 = .5 - .5 = 0; delta0 = 0 -> A = .5,.5,.5
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert adv.tolist() == [0.5, 0.5, 0.5]
    assert ret.tolist() == [1.0, 1.0, 1.0]
    # gamma .9, lam .5: delta2 = .5, A2 = .5; delta1 = .9*.5 - .5 = -.05, A1 = -.05 + .45*.5 = .175
    # delta0 = -.05, A0 = -.05 + .45*.175 = .02875; returns = A + V = .52875, .675, 1.0
    adv, ret = gae(r, v, m, 0.9, 0.5)
    assert adv.tolist() == pytest.approx([0.02875, 0.175, 0.5])
    assert ret.tolist() == pytest.approx([0.52875, 0.675, 1.0])


def test_gae_skips_observation_tokens():
    r = torch.tensor([0.0, 0.0, 1.0])
    v = torch.tensor([0.5, 100.0, 0.25])  # the observation token's value is never used
    m = torch.tensor([1.0, 0.0, 1.0])
    # A2 = 1 - .25 = .75 ; delta0 = 0 + 1*.25 - .5 = -.25 ; A0 = -.25 + .75 = .5
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert adv.tolist() == [0.5, 0.0, 0.75]
    assert ret.tolist() == [1.0, 0.0, 1.0]


def test_compute_gae_whitens_over_the_batch():
    groups = [[sample(1.0), sample(0.0)]]
    values = ((torch.zeros(4), torch.zeros(4)),)
    adv, ret = compute_gae(groups, values, AlgorithmConfig(advantage="gae"))
    # V = 0, gamma = lam = 1: raw A = returns = 1,1 and 0,0 -> whitened: mean .5, var 1/3
    w = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert adv[0][0].tolist() == pytest.approx([0, 0, w, w], abs=1e-6)
    assert adv[0][1].tolist() == pytest.approx([0, 0, -w, -w], abs=1e-6)
    assert ret[0][0].tolist() == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(groups, AlgorithmConfig(advantage="gae"))


def test_vector_or_missing_reward_is_an_error():
    with pytest.raises(ValueError, match="aggregate vector rewards"):
        compute_advantages([[sample((1.0, 2.0))]], AlgorithmConfig())
    with pytest.raises(ValueError, match="reward None"):
        compute_advantages([[sample(None)]], AlgorithmConfig())


def test_the_last_trained_token_is_the_last_nonzero_of_the_mask() -> None:
    for mask in [(0, 0, 1, 1), (1, 0, 0), (0, 1, 0, 1, 0), (0, 0), (), (True, False), (1,)]:
        nonzero = torch.tensor(mask, dtype=torch.float32).nonzero().flatten().tolist()
        assert last_trained(mask) == (nonzero[-1] if nonzero else None), mask


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_outcome_scores_are_bit_equal_to_summed_token_rewards(estimator: str) -> None:
    """The scores read from the samples and broadcast in one buffer are the bits of the path
    they replace: each sequence's per-token outcome rewards summed, then float(A) * mask."""
    import random

    rng = random.Random(1)
    rewards = [0.1, -0.0, 1 / 3, -2.5, 1e-9, 0.0, 7.0]
    groups = [
        tuple(
            sample(
                rng.choice(rewards),
                mask=tuple(rng.choice((0, 1, 1)) for _ in range(rng.randrange(2, 9))),
                group=g,
                index=i,
            )
            for i in range(rng.randrange(1, 5))
        )
        for g in range(30)
    ]
    groups.append((sample(5.0, mask=(0, 0, 0)), sample(1.0)))  # no trained token: score 0
    config = AlgorithmConfig(advantage=estimator)
    got = compute_advantages(groups, config)
    per_token = outcome_token_rewards(groups)
    norm = estimator == "grpo"
    for g, group in enumerate(groups):
        scores = torch.tensor([float(r.sum()) for r in per_token[g]])
        seq = grpo_scores(scores, norm) if estimator != "rloo" else rloo_scores(scores)
        for i, s in enumerate(group):
            want = float(seq[i]) * torch.tensor(s.loss_mask, dtype=torch.float32)
            assert got[g][i].view(torch.int32).tolist() == want.view(torch.int32).tolist()
    same = compute_advantages(groups, config, token_rewards=per_token)
    assert all(
        torch.equal(a, b)
        for r1, r2 in zip(got, same, strict=True)
        for a, b in zip(r1, r2, strict=True)
    )
