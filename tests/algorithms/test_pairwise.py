"""Pairwise preference: pair selection, loss and coefficients, micro-batched gradient check."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollouts.algorithms.algorithm import Algorithm
from rollouts.algorithms.batch import make_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.algorithms.pairwise import (
    all_pairs_above_margin,
    best_vs_worst,
    groups_of,
    make_pair_selector,
    pair_coefficients,
    prepare_pairwise_batch,
    select_pairs,
)
from rollouts.algorithms.schedule import grpo_then_pairwise_schedule
from rollouts.config import AlgorithmConfig, ConfigError, PairwiseConfig
from rollouts.plugins import PluginError
from rollouts.types import ModelOutputs, Sample, Status


def scored(rewards, group_index=0, tokens=(1, 2, 3), response_length=2):
    mask = (0,) * (len(tokens) - response_length) + (1,) * response_length
    return tuple(
        Sample(
            index=group_index,
            group_index=group_index,
            prompt="p",
            tokens=tuple(tokens),
            loss_mask=mask,
            response_length=response_length,
            reward=r,
            status=Status.COMPLETED,
        )
        for r in rewards
    )


def last_two(group):
    """A user selector: (last, second to last)."""
    return [(len(group) - 1, len(group) - 2)] if len(group) >= 2 else []


def test_best_vs_worst():
    # first max (index 1), first min (index 2)
    assert best_vs_worst(scored([0.5, 1.0, 0.0, 1.0, 0.0])) == [(1, 2)]
    assert best_vs_worst(scored([1.0, 1.0])) == []  # all equal: no pair
    assert best_vs_worst(scored([0.3])) == []  # group of one
    assert best_vs_worst(scored([0.0, 1.0]), margin=1.0) == []  # 1 - 0 is not > 1
    assert best_vs_worst(scored([0.0, 1.0]), margin=0.5) == [(1, 0)]


def test_all_pairs_above_margin():
    group = scored([0.5, 1.0, 0.0, 1.0])
    # r_i > r_j: 0>2, 1>0, 1>2, 3>0, 3>2 (ties 1 vs 3 give no pair)
    assert all_pairs_above_margin(0.0)(group) == [(0, 2), (1, 0), (1, 2), (3, 0), (3, 2)]
    # r_i - r_j > 0.5: only 1>2 and 3>2 (differences of exactly 0.5 do not count)
    assert all_pairs_above_margin(0.5)(group) == [(1, 2), (3, 2)]
    assert all_pairs_above_margin(0.0)(scored([2.0, 2.0, 2.0])) == []
    assert all_pairs_above_margin(0.0)(scored([2.0])) == []


def test_selector_from_config_and_flat_indices():
    groups = [scored([0.0, 1.0], 0), scored([3.0, 2.0, 1.0], 1)]
    config = PairwiseConfig()
    assert select_pairs(groups, make_pair_selector(config)) == ((1, 0), (2, 4))
    config = PairwiseConfig(selector="all_pairs_above_margin")
    assert select_pairs(groups, make_pair_selector(config)) == (
        (1, 0), (2, 3), (2, 4), (3, 4),
    )  # fmt: skip
    user = PairwiseConfig(selector="tests.algorithms.test_pairwise.last_two")
    assert select_pairs(groups, make_pair_selector(user)) == ((1, 0), (4, 3))
    with pytest.raises(PluginError, match="no_such_fn"):
        make_pair_selector(PairwiseConfig(selector="tests.algorithms.no_such_fn"))
    with pytest.raises(ValueError, match=r"returned \(0, 0\) for group 0"):
        select_pairs(groups, lambda g: [(0, 0)])
    with pytest.raises(ValueError, match="scalar rewards"):
        best_vs_worst(scored([(1.0, 2.0), (0.0, 1.0)]))


def test_config_checks():
    with pytest.raises(ConfigError, match="pairwise.beta"):
        PairwiseConfig(beta=0.0)
    with pytest.raises(ConfigError, match="pairwise.margin"):
        PairwiseConfig(margin=-1.0)
    with pytest.raises(ConfigError, match="pairwise.selector = 'best'"):
        PairwiseConfig(selector="best")
    with pytest.raises(ConfigError, match="pairwise"):
        AlgorithmConfig(policy_loss="pairwise", advantage="gae")
    assert Algorithm(config=AlgorithmConfig(policy_loss="pairwise")).needs_reference
    assert not Algorithm(config=AlgorithmConfig()).needs_reference


LOSS_1 = math.log(1 + math.exp(-1.0))  # softplus(-1) = .3132617
LOSS_05 = math.log(1 + math.exp(-0.5))  # softplus(-.5) = .4740770


def test_pair_coefficients_hand_values():
    # S_old = [-1, -3, -1], S_ref = [-2, -2, -1] -> margins m = S - R = [1, -1, 0] ; beta = .5
    s_old = torch.tensor([-1.0, -3.0, -1.0])
    s_ref = torch.tensor([-2.0, -2.0, -1.0])
    stats = pair_coefficients([(0, 1), (0, 2), (1, 2)], s_old, s_ref, beta=0.5)
    # Deltas: 1-(-1) = 2, 1-0 = 1, -1-0 = -1 ; beta*Delta = 1, .5, -.5
    # w = beta * sigmoid(-beta*Delta): .5*.2689414 = .1344707, .5*.3775407 = .1887703,
    #     .5*.6224593 = .3112297
    # coef_0 = -w1 - w2 = -.3232410 ; coef_1 = +w1 - w3 = -.1767590 ; coef_2 = w2 + w3 = .5
    assert stats.coefficients == pytest.approx([-0.3232410, -0.1767590, 0.5], abs=1e-7)
    # loss = mean(softplus(-1), softplus(-.5), softplus(.5) = .5 + softplus(-.5)) = .5871386
    assert stats.loss == pytest.approx((LOSS_1 + 2 * LOSS_05 + 0.5) / 3)
    assert stats.loss == pytest.approx(0.5871386, abs=1e-7)
    assert stats.accuracy == pytest.approx(2 / 3)
    assert stats.num_pairs == 3
    empty = pair_coefficients([], s_old, s_ref, beta=0.5)
    assert (empty.coefficients, empty.loss, empty.accuracy) == ((0.0, 0.0, 0.0), 0.0, 0.0)


def test_prepare_pairwise_batch_hand_values():
    groups = [scored([1.0, 0.0], 0), scored([0.5, 0.5], 1)]  # group 1 ties: no pair
    samples = [s for g in groups for s in g]
    batch = make_train_batch(samples, [torch.zeros(3)] * 4)
    # sequence sums over the 2 response tokens: old [-1, -3, *, *], ref [-2, -2, *, *]
    old = [torch.tensor([0.0, -0.5, -0.5]), torch.tensor([0.0, -1.0, -2.0])] + [torch.zeros(3)] * 2
    ref = [torch.tensor([9.0, -1.0, -1.0]), torch.tensor([9.0, -1.5, -0.5])] + [torch.zeros(3)] * 2
    batch = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=tuple(ref))
    config = AlgorithmConfig(policy_loss="pairwise", pairwise=PairwiseConfig(beta=0.5))
    prepared = prepare_pairwise_batch(batch, groups, config)
    # one pair (0, 1), Delta = 2: advantage = -coef = +/- .1344707 on trained tokens
    w = 0.5 * torch.sigmoid(torch.tensor(-1.0)).item()
    assert prepared.advantages[0].tolist() == pytest.approx([0.0, w, w])
    assert prepared.advantages[1].tolist() == pytest.approx([0.0, -w, -w])
    assert prepared.advantages[2].tolist() == [0.0, 0.0, 0.0]
    assert prepared.metadata["num_pairs"] == 1
    assert prepared.metadata["pairwise_loss"] == pytest.approx(LOSS_1)
    assert prepared.metadata["pair_accuracy"] == 1.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        prepare_pairwise_batch(dataclasses.replace(batch, ref_logprobs=()), groups, config)
    with pytest.raises(ValueError, match="prepare_pairwise_batch"):
        make_loss_fn(config)(ModelOutputs(logprobs=batch.old_logprobs), batch)
    assert groups_of(groups, [2, 3]) == [groups[1]]


def bigram_logprobs(table: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
    """logp[t] = log softmax(table[tokens[t-1]])[tokens[t]], position 0 is 0."""
    ids = torch.tensor(tokens)
    logp = torch.log_softmax(table[ids[:-1]], dim=-1).gather(1, ids[1:, None])[:, 0]
    return torch.cat([logp.new_zeros(1), logp])


def shifted(s: Sample, k: int) -> Sample:
    """`s` with its response tokens shifted by k (a different response to the same prompt)."""
    response = tuple((t + k) % 6 for t in s.response_tokens)
    return dataclasses.replace(s, tokens=s.prompt_tokens + response)


def test_micro_batched_gradient_equals_exact_pairwise_gradient():
    torch.manual_seed(0)
    table = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    ref_table = torch.randn(6, 6, dtype=torch.float64)
    groups = [
        scored([1.0, 0.0, 0.5], 0, tokens=(1, 2, 3, 4, 5), response_length=3),
        scored([0.0, 2.0], 1, tokens=(0, 5, 4, 3), response_length=2),
    ]
    # different responses per sample (same prompt within a group)
    groups = [tuple(shifted(s, k) for k, s in enumerate(g)) for g in groups]
    samples = [s for g in groups for s in g]
    config = AlgorithmConfig(
        policy_loss="pairwise",
        pairwise=PairwiseConfig(beta=0.3, selector="all_pairs_above_margin"),
    )
    with torch.no_grad():
        old = tuple(bigram_logprobs(table, s.tokens).float() for s in samples)
        ref = tuple(bigram_logprobs(ref_table, s.tokens).float() for s in samples)
    batch = make_train_batch(samples, [torch.zeros(len(s.tokens)) for s in samples])
    batch = dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref)
    batch = prepare_pairwise_batch(batch, groups, config)
    loss_fn = make_loss_fn(config)
    total, metrics = 0.0, {}
    for i in range(len(samples)):  # one sequence per micro-batch: pairs are split
        logp = bigram_logprobs(table, samples[i].tokens)
        loss, m = loss_fn(ModelOutputs(logprobs=(logp,)), batch.select([i]))
        loss.backward()
        total += float(loss.detach())
        metrics = {k: metrics.get(k, 0.0) + v for k, v in m.items()}
    micro_grad = table.grad.clone()
    table.grad = None
    # exact: pairs (0,1), (0,2), (2,1) in group 0 ; (4,3) in group 1
    pairs = [(0, 1), (0, 2), (2, 1), (4, 3)]
    seq = [(bigram_logprobs(table, s.tokens) * torch.tensor(s.loss_mask)).sum() for s in samples]
    seq_ref = [
        float((r * torch.tensor(s.loss_mask)).sum()) for r, s in zip(ref, samples, strict=True)
    ]
    deltas = torch.stack([(seq[c] - seq_ref[c]) - (seq[r] - seq_ref[r]) for c, r in pairs])
    exact = -torch.nn.functional.logsigmoid(0.3 * deltas).mean()
    exact.backward()
    exact = exact.detach()
    assert batch.metadata["num_pairs"] == 4
    assert float(micro_grad.abs().sum()) > 0.1
    torch.testing.assert_close(micro_grad, table.grad, rtol=1e-5, atol=1e-6)
    assert total == pytest.approx(float(exact), rel=1e-5)
    assert metrics["pairwise_loss"] == pytest.approx(float(exact), rel=1e-5)
    assert metrics["pair_accuracy"] == pytest.approx(float((deltas > 0).double().mean()))
    assert metrics["pairs"] == pytest.approx(4.0)


def test_schedule_switches_grpo_to_pairwise():
    assert grpo_then_pairwise_schedule(0).policy_loss == "ppo"
    assert grpo_then_pairwise_schedule(19).policy_loss == "ppo"
    later = grpo_then_pairwise_schedule(20)
    assert (later.policy_loss, later.pairwise.beta) == ("pairwise", 0.1)
    assert Algorithm(config=later).needs_reference
