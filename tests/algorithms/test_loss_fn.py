"""make_loss_fn / make_train_batch: the LossFn seam, global normalisation, accumulation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollouts.algorithms.advantages import outcome_token_rewards
from rollouts.algorithms.batch import build_train_batch, make_train_batch, nest
from rollouts.algorithms.kl import kl_reward_penalties
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import (
    AGG_MODES,
    AlgorithmConfig,
    CispoConfig,
    GAEConfig,
    KLConfig,
    TruncatedISConfig,
)
from rollouts.config import RolloutCorrectionConfig as RCC
from rollouts.types import ModelOutputs, Sample, Status, TrainBatch


def sample(tokens, mask, response_length, rollout=(), index=0, status=Status.COMPLETED):
    return Sample(
        index=index,
        group_index=0,
        prompt="p",
        tokens=tuple(tokens),
        loss_mask=tuple(mask),
        response_length=response_length,
        rollout_logprobs=tuple(rollout),
        reward=1.0,
        status=status,
    )


def small_batch(rollout=((0.0, 0.0), (0.0,))) -> TrainBatch:
    samples = [
        sample([5, 6, 7], [0, 1, 1], 2, rollout[0]),
        sample([5, 8], [0, 1], 1, rollout[1], index=1),
    ]
    adv = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, -1.0])]
    return make_train_batch(samples, adv)


def test_make_train_batch_aligns_and_counts():
    samples = [
        sample([1, 2, 3, 4], [0, 0, 1, 1], 2, (-0.5, -0.25)),
        sample([1, 2, 3], [0, 0, 0], 1, (-1.0,), index=1),  # all masked
    ]
    adv = [torch.tensor([9.0, 9.0, 1.0, 2.0]), torch.zeros(3)]
    batch = make_train_batch(samples, adv, max_response_length=16)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4]
    assert batch.advantages[0].tolist() == [0.0, 0.0, 1.0, 2.0]  # masked positions zeroed
    assert batch.rollout_logprobs[0].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert batch.rollout_logprobs[1].tolist() == [0.0, 0.0, -1.0]
    # N = 2 trained tokens, B = 1 sequence with any, T_max as given
    assert (batch.num_global_tokens, batch.num_global_seqs) == (2.0, 1.0)
    assert batch.max_response_length == 16
    assert make_train_batch(samples, adv).max_response_length == 2  # longest response
    micro = batch.select([1])
    assert micro.num_global_tokens == 2.0  # select keeps the global normalisers
    failed = dataclasses.replace(samples[0], status=Status.FAILED)
    with pytest.raises(AssertionError, match="failed"):
        make_train_batch([failed], adv[:1])


def outputs_for(logps, entropy=()):
    return ModelOutputs(logprobs=tuple(torch.tensor(x) for x in logps), entropy=entropy)


def test_ppo_token_mean_hand_values():
    batch = small_batch()
    logps = [[0.0, math.log(1.5), math.log(0.5)], [0.0, math.log(4.0)]]
    old = (torch.zeros(3), torch.zeros(2))
    batch = dataclasses.replace(batch, old_logprobs=old)
    loss, metrics = make_loss_fn(AlgorithmConfig())(outputs_for(logps), batch)
    # per-token losses (see test_losses): -1.2 (A=1, r=1.5), -0.5 (A=1, r=.5), 3 (A=-1, r=4 dual)
    # token-mean over N = 3: (-1.2 - .5 + 3) / 3 = 1.3 / 3
    assert loss.item() == pytest.approx(1.3 / 3, rel=1e-6)
    assert metrics["pg_loss"] == pytest.approx(1.3 / 3, rel=1e-6)
    assert metrics["clipfrac"] == pytest.approx(1 / 3)
    assert metrics["dual_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["clipfrac_high"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 4) / 3)
    # ppo_kl = mean(old - logp) = -(log 1.5 + log .5 + log 4) / 3 = -log 3 / 3
    assert metrics["ppo_kl"] == pytest.approx(-math.log(3) / 3, rel=1e-6)
    # the rollout logprobs are 0 like old: mismatch 0
    assert metrics["logprob_mismatch"] == 0.0


def test_tis_in_the_loss_is_detached_and_truncated():
    # no old_logprobs: old = logp.detach() = 0 -> ratio 1; rollout -log 1.5, -log 3 -> w 1.5, 2
    batch = small_batch(rollout=((-math.log(1.5), -math.log(3.0)), (0.0,)))
    logp = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    loss_fn = make_loss_fn(AlgorithmConfig(rollout_correction=RCC(tis=True, tis_cap=2.0)))
    loss, metrics = loss_fn(ModelOutputs(logprobs=tuple(logp)), batch)
    # per-token -A r w: -1.5, -2, +1 -> / N=3
    assert loss.item() == pytest.approx((-1.5 - 2.0 + 1.0) / 3, rel=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx((1.5 + 2 + 1) / 3)
    assert metrics["tis_truncated_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # gradient -A w / N (weights detached); with w attached to logp it would be doubled
    assert logp[0].grad.tolist() == pytest.approx([0.0, -0.5, -2 / 3], rel=1e-6)
    assert logp[1].grad.tolist() == pytest.approx([0.0, 1 / 3], rel=1e-6)
    no_rollout = dataclasses.replace(batch, rollout_logprobs=())
    with pytest.raises(ValueError, match="rollout_logprobs"):
        loss_fn(ModelOutputs(logprobs=tuple(logp)), no_rollout)


def test_cispo_hand_values_every_token_keeps_a_gradient():
    batch = small_batch()
    logp = [
        torch.tensor([0.0, math.log(1.5), math.log(0.5)], requires_grad=True),
        torch.tensor([0.0, math.log(4.0)], requires_grad=True),
    ]
    batch = dataclasses.replace(batch, old_logprobs=(torch.zeros(3), torch.zeros(2)))
    config = AlgorithmConfig(policy_loss="cispo", cispo=CispoConfig(clip_eps_high=0.28))
    loss, metrics = make_loss_fn(config)(ModelOutputs(logprobs=tuple(logp)), batch)
    # weights sg(clamp(r, 0, 1.28)): r = 1.5 -> 1.28, r = .5 -> .5 (no lower bound), r = 4 -> 1.28
    # l = -w A logp: -1.28 log 1.5, -.5 log .5, +1.28 log 4 ; token-mean over N = 3
    expected = (-1.28 * math.log(1.5) - 0.5 * math.log(0.5) + 1.28 * math.log(4.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clipfrac"] == pytest.approx(2 / 3)  # weights clipped, tokens still trained
    loss.backward()
    # dl/dlogp = -w A / N on every token; PPO would give 0 for r = 1.5 (A > 0, clipped)
    assert logp[0].grad.tolist() == pytest.approx([0.0, -1.28 / 3, -0.5 / 3], rel=1e-6)
    assert logp[1].grad.tolist() == pytest.approx([0.0, 1.28 / 3], rel=1e-6)
    ppo = [t.detach().clone().requires_grad_(True) for t in logp]
    make_loss_fn(AlgorithmConfig())(ModelOutputs(logprobs=tuple(ppo)), batch)[0].backward()
    assert ppo[0].grad[1].item() == 0.0


def test_truncated_is_hand_values_and_cispo_equivalence():
    """policy_loss = "truncated_is": l = -sg(min(r, C)) A logp, r = pi / pi_old, C = 2."""
    batch = dataclasses.replace(small_batch(), old_logprobs=(torch.zeros(3), torch.zeros(2)))
    values = [[0.0, math.log(1.5), math.log(3.0)], [0.0, math.log(4.0)]]
    logp = [torch.tensor(v, requires_grad=True) for v in values]
    config = AlgorithmConfig(policy_loss="truncated_is", truncated_is=TruncatedISConfig(cap=2.0))
    loss, metrics = make_loss_fn(config)(ModelOutputs(logprobs=tuple(logp)), batch)
    # r = 1.5, 3, 4 -> weights 1.5, 2, 2 (truncated at C = 2, no lower bound); A = +1, +1, -1
    # l = -1.5 log 1.5, -2 log 3, +2 log 4 ; token-mean over N = 3
    expected = (-1.5 * math.log(1.5) - 2.0 * math.log(3.0) + 2.0 * math.log(4.0)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-7)  # float32: r = exp(log 1.5)
    assert metrics["clipfrac"] == pytest.approx(2 / 3)  # r = 3 and r = 4 truncated
    assert metrics["clipfrac_high"] == pytest.approx(1 / 3)  # of them, A > 0: r = 3
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 3.0 + 4.0) / 3)
    loss.backward()
    # dl/dlogp = -w A / N on every token (weights detached): the clipped PPO gives r = 3 none
    assert logp[0].grad.tolist() == pytest.approx([0.0, -1.5 / 3, -2.0 / 3], rel=1e-6)
    assert logp[1].grad.tolist() == pytest.approx([0.0, 2.0 / 3], rel=1e-6)
    cispo = AlgorithmConfig(
        policy_loss="cispo", cispo=CispoConfig(clip_eps_low=1.0, clip_eps_high=1.0)
    )
    same = [torch.tensor(v, requires_grad=True) for v in values]
    cispo_loss, _ = make_loss_fn(cispo)(ModelOutputs(logprobs=tuple(same)), batch)
    cispo_loss.backward()
    assert cispo_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(same, logp, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    ("mode", "loss", "dropped", "dropped_seqs"),
    [
        ("token", -1 / 3, 2 / 3, 1.0),  # ratio 3 and ratio .4 tokens dropped
        ("sequence", 0.0, 1.0, 1.0),  # seq 0: 1.5 * 3 = 4.5 > 2.2 ; seq 1: .4 < 1 / 2.2
        ("geometric", -2 / 3, 1 / 3, 0.5),  # seq 0: sqrt(4.5) = 2.12 kept ; seq 1 dropped
    ],
)
def test_rollout_rejection_modes_hand_values(mode, loss, dropped, dropped_seqs):
    # logp = old = -1 everywhere (ratio 1, per-token loss -A); engine logprobs chosen so that
    # pi_trainer / pi_engine = exp(old - rollout) is 1.5, 3 (seq 0) and 0.4 (seq 1)
    rollout = ((-1 - math.log(1.5), -1 - math.log(3.0)), (-1 + math.log(2.5),))
    batch = small_batch(rollout=rollout)
    outputs = outputs_for([[-1.0] * 3, [-1.0] * 2])
    config = AlgorithmConfig(rollout_correction=RCC(rejection=mode, rejection_threshold=2.2))
    value, metrics = make_loss_fn(config)(outputs, batch)
    # kept tokens of -1, -1, +1 summed over N = 3 (the batch's N: rejected tokens weigh 0)
    assert value.item() == pytest.approx(loss, abs=1e-6)
    assert metrics["rollout_rs_dropped_frac"] == pytest.approx(dropped)
    assert metrics["rollout_rs_dropped_seq_frac"] == pytest.approx(dropped_seqs)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        make_loss_fn(config)(outputs, dataclasses.replace(batch, rollout_logprobs=()))


def test_entropy_and_kl_terms():
    batch = small_batch()
    ref = (torch.tensor([0.0, math.log(0.5), 0.0]), torch.tensor([0.0, 0.0]))
    batch = dataclasses.replace(batch, ref_logprobs=ref)
    entropy = (torch.tensor([9.0, 1.0, 2.0]), torch.tensor([9.0, 3.0]))
    config = AlgorithmConfig(entropy_coef=0.1, kl=KLConfig(coef=0.5, estimator="k1"))
    loss, metrics = make_loss_fn(config)(outputs_for([[0.0] * 3, [0.0] * 2], entropy), batch)
    # pg: ratio 1 -> -A: (-1 - 1 + 1) / 3 = -1/3 ; entropy (1 + 2 + 3) / 3 = 2
    # k1 = logp - ref = log 2, 0, 0 -> mean log2 / 3
    expected = -1 / 3 - 0.1 * 2.0 + 0.5 * math.log(2) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert metrics["kl"] == pytest.approx(math.log(2) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_loss_fn(config)(outputs_for([[0.0] * 3, [0.0] * 2], entropy), small_batch())
    with pytest.raises(ValueError, match="entropy"):
        make_loss_fn(config)(outputs_for([[0.0] * 3, [0.0] * 2]), batch)


def test_an_untrained_entropy_is_a_metric_outside_the_graph():
    """entropy_coef = 0: the entropy is reported but never enters the loss's graph (its
    backward through [N, V] would be wasted); the loss equals the one without entropy."""
    batch = small_batch()
    entropy = (torch.tensor([9.0, 1.0, 2.0], requires_grad=True), torch.tensor([9.0, 3.0]))
    logps = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    loss_fn = make_loss_fn(AlgorithmConfig(entropy_coef=0.0))
    assert not loss_fn.needs_entropy
    loss, metrics = loss_fn(ModelOutputs(logprobs=tuple(logps), entropy=entropy), batch)
    plain, _ = loss_fn(ModelOutputs(logprobs=tuple(logps)), batch)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert loss.item() == plain.item()
    loss.backward()
    assert entropy[0].grad is None and logps[0].grad is not None


def random_batch(seed: int) -> tuple[TrainBatch, list[torch.Tensor]]:
    """8 sequences of different lengths (one all masked) with random advantages and logprobs."""
    gen = torch.Generator().manual_seed(seed)
    samples, adv, old, ref, params = [], [], [], [], []
    for i in range(8):
        n = 4 + i
        prompt = 2
        mask = [0] * prompt + [1] * (n - prompt)
        if i == 3:
            mask = [0] * n  # an all-masked row
        if i == 5:
            mask[prompt + 1] = 0  # an observation token
        rollout = (-torch.rand(n - prompt, generator=gen)).tolist()
        samples.append(sample(list(range(n)), mask, n - prompt, rollout, index=i))
        adv.append(torch.randn(n, generator=gen))
        old.append(-torch.rand(n, generator=gen))
        ref.append(-torch.rand(n, generator=gen))
        params.append((-torch.rand(n, generator=gen) - 0.05).requires_grad_(True))
    batch = make_train_batch(samples, adv, max_response_length=12)
    batch = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=tuple(ref))
    return batch, params


def grads(loss_fn, batch, params, micro_batches):
    for p in params:
        p.grad = None
    total_metrics: dict[str, float] = {}
    for indices in micro_batches:
        micro = batch.select(indices)
        entropy = tuple(-params[i] * 0.5 for i in indices)  # any differentiable stand-in
        outputs = ModelOutputs(logprobs=tuple(params[i] for i in indices), entropy=entropy)
        loss, metrics = loss_fn(outputs, micro)
        loss.backward()
        for k, v in metrics.items():
            total_metrics[k] = total_metrics.get(k, 0.0) + v
    return [p.grad.clone() for p in params], total_metrics


COMBOS = [(p, m) for p in ("ppo", "reinforce") for m in AGG_MODES]
COMBOS.append(("gspo", "seq-mean-token-mean"))  # GSPO is defined with this mode only
COMBOS += [(p, m) for p in ("cispo", "truncated_is") for m in AGG_MODES]


@pytest.mark.parametrize(("policy", "mode"), COMBOS)
def test_gradient_accumulation_equals_full_batch(policy, mode):
    batch, params = random_batch(seed=1)
    config = AlgorithmConfig(
        policy_loss=policy,
        loss_agg=mode,
        entropy_coef=0.01,
        kl=KLConfig(coef=0.1),
        rollout_correction=RCC(tis=True),
        clip_eps_high=0.28,
    )
    loss_fn = make_loss_fn(config)
    full, full_metrics = grads(loss_fn, batch, params, [list(range(8))])
    micro, micro_metrics = grads(loss_fn, batch, params, [[0, 1], [2, 3], [4, 5], [6, 7]])
    for a, b in zip(full, micro, strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    assert any(float(g.abs().sum()) > 0 for g in full)
    assert full_metrics.keys() == micro_metrics.keys()
    for key, value in full_metrics.items():
        assert micro_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_rl_loop_order_with_kl_in_reward():
    """The order the RL loop follows: batch -> logprobs -> KL penalties -> advantages -> loss."""
    groups = [
        [sample([1, 2, 3], [0, 1, 1], 2, (-0.1, -0.2)), sample([1, 4], [0, 1], 1, (-0.3,), 1)],
    ]
    groups = [[dataclasses.replace(groups[0][1], reward=0.0), groups[0][0]]]
    config = AlgorithmConfig(advantage="dr_grpo", kl=KLConfig(into="reward", estimator="k1"))
    first = build_train_batch(groups, config)
    old = (torch.tensor([0.0, -0.5]), torch.tensor([0.0, -0.1, -0.2]))  # from the backend
    ref = (torch.tensor([0.0, -0.5]), torch.tensor([0.0, -0.1 - 0.5, -0.2]))
    penalties, kl = kl_reward_penalties(old, ref, first.loss_mask, config.kl, coef=0.2)
    # k1 = old - ref: sample 1 token 1 = .5 -> penalty .1 ; batch KL = .5 / 3 tokens
    assert kl == pytest.approx(0.5 / 3)
    rewards = outcome_token_rewards(groups, nest(penalties, groups))
    batch = build_train_batch(groups, config, token_rewards=rewards)
    # scores: 0 and 1 - .1 = .9 -> mean .45 -> Dr.GRPO -.45, +.45 on trained tokens
    assert batch.advantages[0].tolist() == pytest.approx([0.0, -0.45])
    assert batch.advantages[1].tolist() == pytest.approx([0.0, 0.45, 0.45])
    batch = dataclasses.replace(batch, old_logprobs=old)
    loss, metrics = make_loss_fn(config)(ModelOutputs(logprobs=old), batch)
    # ratio 1: token-mean of -A over 3 tokens = (.45 - .45 - .45) / 3
    assert loss.item() == pytest.approx(-0.15)
    # mismatch |old - rollout|: |-.5 + .3| + |-.1 + .1| + |-.2 + .2| = .2 over 3
    assert metrics["logprob_mismatch"] == pytest.approx(0.2 / 3)


def test_gae_batch_and_value_loss():
    groups = [[sample([1, 2, 3], [0, 1, 1], 2)]]
    config = AlgorithmConfig(advantage="gae", gae=GAEConfig(value_coef=0.5))
    values = ((torch.tensor([0.0, 0.5, 0.5]),),)
    batch = build_train_batch(groups, config, values=values)
    # r = (0, 1) on the trained tokens; gamma = lam = 1: A2 = 1 - .5 = .5 ; A1 = 0 + .5 - .5 + .5
    # returns = A + V = 1, 1
    assert batch.returns[0].tolist() == [0.0, 1.0, 1.0]
    assert make_loss_fn(config).needs_values
    outputs = ModelOutputs(logprobs=(torch.zeros(3),), values=(torch.tensor([0.0, 0.5, 1.2]),))
    _, metrics = make_loss_fn(config)(outputs, batch)
    # value loss: token 1: .5 * (.5 - 1)^2 = .125 ; token 2: v 1.2 clipped to .7:
    # .5 * max((.2)^2, (-.3)^2) = .045 -> token-mean (.125 + .045) / 2 = .085
    assert metrics["value_loss"] == pytest.approx(0.085)
    assert metrics["value_clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="critic"):
        build_train_batch(groups, config)


@pytest.mark.parametrize("policy", ["ppo", "cispo"])
@pytest.mark.parametrize(
    ("mode", "threshold"), [("token", 1.5), ("sequence", 1.5), ("geometric", 1.1)]
)
def test_gradient_accumulation_with_rollout_rejection(policy, mode, threshold):
    batch, params = random_batch(seed=2)
    correction = RCC(rejection=mode, rejection_threshold=threshold, tis=True)
    config = AlgorithmConfig(policy_loss=policy, rollout_correction=correction)
    loss_fn = make_loss_fn(config)
    full, full_metrics = grads(loss_fn, batch, params, [list(range(8))])
    micro, micro_metrics = grads(loss_fn, batch, params, [[0, 1, 2], [3, 4], [5, 6, 7]])
    for a, b in zip(full, micro, strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    assert 0.0 < full_metrics["rollout_rs_dropped_frac"] < 1.0  # some kept, some rejected
    for key, value in full_metrics.items():
        assert micro_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
