"""KL estimators, truncation, exact KL, KL in the reward, adaptive coefficient."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from rollouts.algorithms.kl import (
    AdaptiveKL,
    batch_kl,
    forward_kl,
    full_kl_chunked,
    kl_estimate,
    kl_reward_penalties,
    reverse_kl,
    sequence_mean_kl,
    truncate_kl,
)
from rollouts.config import AlgorithmConfig, ConfigError, KLConfig

LN2 = math.log(2.0)


def test_estimators_hand_values():
    logp = torch.tensor([0.0, -LN2])
    ref = torch.tensor([-LN2, 0.0])
    # d = logp - ref = +ln2, -ln2
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([LN2, -LN2])
    assert kl_estimate(logp, ref, "abs").tolist() == pytest.approx([LN2, LN2])
    # k2 = .5 d^2 = .5 * .480453 = .240227
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5 * LN2**2] * 2)
    # k3: x = -d; e^x - x - 1: d=+ln2 -> .5 + ln2 - 1 = .193147 ; d=-ln2 -> 2 - ln2 - 1 = .306853
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([LN2 - 0.5, 1 - LN2])


def test_k3_is_clamped():
    # d = -30: x = clamp(30) = 20 -> e^20 - 21 -> clamp 10 ; d = +30: x = -20 -> e^-20 + 19 -> 10
    out = kl_estimate(torch.tensor([-30.0, 30.0]), torch.zeros(2), "k3")
    assert out.tolist() == [10.0, 10.0]
    assert kl_estimate(torch.zeros(1), torch.zeros(1), "k3").item() == 0.0


def test_truncated_kl():
    kl = torch.tensor([0.5, 3.0, 0.2])
    ref = torch.tensor([math.log(0.99), math.log(0.5), math.log(0.1)])
    # reference confident (p .99 > .95) on token 0 -> 0 ; cap 1 -> token 1 at 1
    out = truncate_kl(kl, ref, cap=1.0, ignore_ref_above=0.95)
    assert out.tolist() == pytest.approx([0.0, 1.0, 0.2])
    assert truncate_kl(kl, ref).tolist() == pytest.approx(kl.tolist())  # defaults: unchanged


def test_exact_kl_directions():
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75]))
    # KL(p||q) = .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln2 + .5 ln(2/3)
    rev = 0.5 * LN2 + 0.5 * math.log(2 / 3)
    # KL(q||p) = .25 ln(.25/.5) + .75 ln(.75/.5) = -.25 ln2 + .75 ln1.5
    fwd = -0.25 * LN2 + 0.75 * math.log(1.5)
    assert reverse_kl(p, q).item() == pytest.approx(rev, rel=1e-5)
    assert forward_kl(p, q).item() == pytest.approx(fwd, rel=1e-5)


def test_kl_in_reward_penalties_and_batch_kl():
    old = [torch.tensor([0.0, 0.0, -LN2])]
    ref = [torch.tensor([5.0, -LN2, 0.0])]
    mask = [torch.tensor([0.0, 1.0, 1.0])]
    config = KLConfig(estimator="k1", into="reward")
    pen, kl = kl_reward_penalties(old, ref, mask, config, coef=0.1)
    # k1 on trained tokens: ln2, -ln2 -> penalties .1 ln2, -.1 ln2 ; batch KL (ln2 - ln2)/2 = 0
    assert pen[0].tolist() == pytest.approx([0.0, 0.1 * LN2, -0.1 * LN2])
    assert kl == pytest.approx(0.0)
    assert batch_kl([torch.tensor([1.0, 3.0])], [torch.tensor([1.0, 1.0])]) == 2.0


def test_adaptive_kl_controller():
    fixed = AdaptiveKL(coef=0.1)
    assert fixed.update(5.0).coef == 0.1  # target 0 = fixed
    ctl = AdaptiveKL(coef=0.1, target=0.1, horizon=10)
    # kl .2: err = clamp(.2/.1 - 1, -.2, .2) = .2 ; coef * (1 + .2 * 1/10) = .1 * 1.02
    assert ctl.update(0.2).coef == pytest.approx(0.102)
    # kl .05: err = -.5 -> -.2 ; .1 * (1 - .2 * 2/10) = .096
    assert ctl.update(0.05, n_steps=2).coef == pytest.approx(0.096)
    cfg = AlgorithmConfig(kl=KLConfig(coef=0.3, target=0.02, horizon=5, into="reward"))
    assert AdaptiveKL.from_config(cfg) == AdaptiveKL(coef=0.3, target=0.02, horizon=5)
    moved = ctl.update(0.2)
    assert ctl.load_state_dict(moved.state_dict()) == moved  # a resume continues with it
    with pytest.raises(ConfigError, match="kl.into = 'reward'"):
        KLConfig(coef=0.3, target=0.02)  # adaptive KL steers the reward's KL


def test_sequence_mean_kl_is_verls_current_kl():
    # verl apply_kl_penalty: masked_mean over each sequence, then the mean over sequences
    old = [torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0.0, 2.0])]
    ref = [torch.zeros(3), torch.zeros(2)]
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    config = KLConfig(estimator="k1")
    # seq 0: (1 + 3) / 2 = 2 ; seq 1: 2 / 1 = 2 -> 2 (the token mean would be 6 / 3 = 2 too)
    assert sequence_mean_kl(old, ref, masks, config) == pytest.approx(2.0)
    old[1] = torch.tensor([0.0, 5.0])
    # seq means 2 and 5 -> 3.5, where the batch token mean is 9 / 3 = 3
    assert sequence_mean_kl(old, ref, masks, config) == pytest.approx(3.5)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 100])
def test_full_kl_chunked_equals_direct(direction, chunk_size):
    torch.manual_seed(1)
    policy = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 5, 7, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    out = full_kl_chunked(policy, ref, mask, direction=direction, chunk_size=chunk_size)
    p, q = Categorical(logits=policy), Categorical(logits=ref)
    direct = kl_divergence(p, q) if direction == "reverse" else kl_divergence(q, p)
    direct = direct * mask
    assert out.shape == (2, 5)
    assert (out[mask == 0] == 0).all()
    torch.testing.assert_close(out.double(), direct, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad((out * torch.arange(10.0).reshape(2, 5)).sum(), policy)
    (want,) = torch.autograd.grad((direct * torch.arange(10.0).reshape(2, 5)).sum(), policy)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no autograd: plain chunks, same values
        plain = full_kl_chunked(policy, ref, mask, direction=direction, chunk_size=chunk_size)
    torch.testing.assert_close(plain, out.detach())


def test_full_kl_chunked_hand_values_and_empty_mask():
    p = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.25, 0.75], [0.25, 0.75]]]))
    mask = torch.tensor([[1.0, 0.0]])
    rev = 0.5 * LN2 + 0.5 * math.log(2 / 3)  # KL(p||q), as in test_exact_kl_directions
    fwd = -0.25 * LN2 + 0.75 * math.log(1.5)  # KL(q||p)
    assert full_kl_chunked(p, q, mask)[0].tolist() == pytest.approx([rev, 0.0], rel=1e-5)
    out = full_kl_chunked(p, q, mask, direction="forward", chunk_size=1)
    assert out[0].tolist() == pytest.approx([fwd, 0.0], rel=1e-5)
    assert full_kl_chunked(p, q, torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]
