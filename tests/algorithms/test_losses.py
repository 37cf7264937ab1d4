"""Per-token losses, aggregation and TIS pinned to hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.algorithms.aggregation import (
    GlobalCounts,
    aggregate,
    global_counts,
    masked_whiten,
)
from rollouts.algorithms.losses import (
    entropy_from_logits,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    value_loss,
)
from rollouts.algorithms.off_policy import logprob_mismatch, tis_weights

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 7.0, 7.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row all masked


def test_global_counts():
    counts = global_counts(list(M))
    # N = 3 trained tokens, B = 2 rows with any, T_max default = longest trained span = 2
    assert counts == GlobalCounts(num_tokens=3.0, num_seqs=2.0, max_response_length=2)
    assert global_counts(list(M), max_response_length=4).max_response_length == 4


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / N=3
        ("seq-mean-token-sum", 3.5),  # ((1+2) + 4) / B=2
        ("seq-mean-token-mean", 2.75),  # ((1+2)/2 + 4/1) / 2
        ("seq-mean-token-sum-norm", 0.875),  # 7 / (B=2 * T_max=4)
    ],
)
def test_aggregate_modes(mode, expected):
    counts = GlobalCounts(num_tokens=3, num_seqs=2, max_response_length=4)
    assert aggregate(L, M, mode, counts).item() == pytest.approx(expected, rel=1e-6)


def test_aggregate_all_masked_is_zero_not_nan():
    counts = GlobalCounts(num_tokens=0, num_seqs=0, max_response_length=0)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(L, torch.zeros_like(M), mode, counts).item() == 0.0


def test_masked_whiten():
    v = torch.tensor([1.0, 3.0, 100.0])
    m = torch.tensor([1.0, 1.0, 0.0])
    # mean 2, unbiased var ((1)+(1))/1 = 2 -> (+-1) / sqrt(2 + 1e-8); masked entry -> 0
    out = masked_whiten(v, m)
    assert out.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], abs=1e-6)


def ppo(logp, old, adv, eps_high=0.2):
    return ppo_clip_loss(logp, old, adv, eps_low=0.2, eps_high=eps_high, clip_ratio_c=3.0)


def test_ppo_clip_and_dual_clip_values():
    ratios = torch.tensor([1.5, 0.5, 0.5, 4.0, 2.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    logp = ratios.log().requires_grad_(True)
    t = ppo(logp, torch.zeros(5), adv)
    # A=1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped high)
    # A=1 r=.5:  max(-.5, -.8) = -.5
    # A=-1 r=.5: max(.5, .8) = .8 (clipped low); min(3, .8) = .8
    # A=-1 r=4:  max(4, 1.2) = 4; dual clip: min(3, 4) = 3
    # A=-1 r=2:  max(2, 1.2) = 2; min(3, 2) = 2
    assert t.loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 3.0, 2.0], rel=1e-6)
    assert t.clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]  # l2 > l1
    assert t.clipped_high.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert t.clipped_low.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert t.dual_clipped.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    t.loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped: token 1: -.5 ; token 4: +2 ; clipped/dual: 0
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, 0.0, 0.0, 2.0], rel=1e-6)


def test_clip_higher():
    logp = torch.tensor([math.log(1.25)])
    # eps_high .2: max(-1.25, -1.2) = -1.2 ; eps_high .28 (DAPO): max(-1.25, -1.25) = -1.25
    assert ppo(logp, torch.zeros(1), torch.ones(1)).loss.item() == pytest.approx(-1.2)
    loss = ppo(logp, torch.zeros(1), torch.ones(1), eps_high=0.28).loss.item()
    assert loss == pytest.approx(-1.25)


def test_reinforce_loss():
    logp = torch.tensor([-0.5, -2.0], requires_grad=True)
    t = reinforce_loss(logp, torch.tensor([2.0, -1.0]))
    # -A logp: -2*-.5 = 1 ; 1*-2 = -2 ; gradient -A
    assert t.loss.tolist() == [1.0, -2.0]
    t.loss.sum().backward()
    assert logp.grad.tolist() == [-2.0, 1.0]


def test_gspo_sequence_ratio_straight_through():
    logp = torch.tensor([[math.log(2.0), 0.0], [math.log(1.1), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    t = gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), mask, eps_low=0.2, eps_high=0.2)
    # row 0: s = exp((log 2 + 0) / 2) = sqrt(2) = 1.414 > 1.2 -> clipped: -1.2 on both tokens
    # row 1: s = exp(log 1.1 / 1) = 1.1 -> -1.1 (position 1 untrained, masked later)
    assert t.ratio[0].tolist() == pytest.approx([math.sqrt(2)] * 2, rel=1e-6)
    assert t.loss[0].tolist() == pytest.approx([-1.2, -1.2], rel=1e-6)
    assert t.loss[1, 0].item() == pytest.approx(-1.1, rel=1e-6)
    (t.loss * mask).sum().backward()
    # straight-through: d(-s_it)/dlogp_t = -s_i per token when unclipped; 0 when clipped
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -1.1, 0.0], rel=1e-6)


def test_value_loss_clipped():
    v = torch.tensor([1.5, 1.1])
    old = torch.tensor([1.0, 1.0])
    ret = torch.tensor([2.0, 2.0])
    loss, clipped = value_loss(v, old, ret, 0.2)
    # v=1.5: v_clip 1.2; max((.5)^2, (.8)^2) = .64 -> .32 ; v=1.1: unclipped (.9)^2 = .81 -> .405
    assert loss.tolist() == pytest.approx([0.32, 0.405])
    assert clipped.tolist() == [1.0, 0.0]


def test_value_clipfrac_is_zero_when_nothing_is_clipped():
    # defect: v_clip = old + clamp(v - old) rounds in fp32, so with a clip range no value reaches
    # (1e3) rounding marked ~10% of tokens as clipped; verl reports 0 here.
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4096, generator=g)
    old = torch.randn(4096, generator=g) * 7.0
    ret = torch.randn(4096, generator=g)
    old_form = old + torch.clamp(v - old, -1e3, 1e3)
    assert ((old_form - ret) ** 2 > (v - ret) ** 2).float().mean() > 0.01  # the old bug
    loss, clipped = value_loss(v, old, ret, 1e3)
    assert clipped.sum().item() == 0.0
    assert torch.equal(loss, 0.5 * (v - ret) ** 2)


def test_entropy_from_logits():
    # uniform over 4 -> log 4 ; one-hot-ish (huge logit) -> ~0
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0, abs=1e-6)


def test_tis_weights_truncated_and_detached():
    old = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-math.log(1.5), -math.log(3.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = tis_weights(old, rollout, mask, cap=2.0)
    # exp(old - rollout) = 1.5 ; 3 -> capped at 2 ; untrained -> 0
    assert w[0].tolist() == pytest.approx([1.5, 2.0, 0.0])
    assert not w.requires_grad
    # sequence level: exp(log 1.5 + log 3) = 4.5 -> capped 2 on every trained token
    ws = tis_weights(old, rollout, mask, cap=2.0, level="sequence")
    assert ws[0].tolist() == pytest.approx([2.0, 2.0, 0.0])
    # a negative log ratio shrinks the weight: exp(-log 4) = .25
    low = tis_weights(torch.zeros(1, 1), torch.tensor([[math.log(4.0)]]), torch.ones(1, 1), cap=2.0)
    assert low.item() == pytest.approx(0.25)


def test_logprob_mismatch():
    old = [torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -0.5])]
    rollout = [torch.tensor([9.0, -1.1, -1.8]), torch.tensor([0.0, -0.2])]
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    # |.1| + |.2| + |.3| over 3 tokens = .2 (position 0 untrained)
    assert logprob_mismatch(old, rollout, masks) == pytest.approx(0.2)
    assert logprob_mismatch([], [], []) == 0.0
