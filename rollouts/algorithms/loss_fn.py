"""`make_loss_fn(config)`: the `LossFn` a training backend calls once per micro-batch.

total = pg_loss(policy_loss, TIS-weighted, rejection-masked) - entropy_coef * agg(entropy)
        + kl_coef * agg(kl(logp, logp_ref))   [kl_in = "loss"]
        + value_coef * agg(value_loss)        [advantage = "gae", when the backend gives values]
policy_loss = "pairwise" replaces pg_loss by the pairwise preference surrogate
(`rollouts.algorithms.pairwise`: sum_i coef_i * sum_t logp_it / num_pairs, loss_agg unused).
Every term is aggregated with `config.loss_agg` and the batch's GLOBAL counts, so a backend sums
the micro-batch losses' gradients (over micro-batches and data-parallel ranks: a backend whose
all-reduce AVERAGES gradients over DP ranks must multiply the loss by the world size). Metrics are
token means over the global N (or sums / global B), so they too are summed by the backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from rollouts.algorithms.aggregation import GlobalCounts, aggregate, seq_mean, token_mean
from rollouts.algorithms.kl import config_kl
from rollouts.algorithms.losses import (
    PolicyTerms,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    value_loss,
)
from rollouts.algorithms.off_policy import rejection_keep_mask, tis_weights
from rollouts.algorithms.pairwise import pairwise_surrogate
from rollouts.config import AlgorithmConfig
from rollouts.types import ModelOutputs, TrainBatch


def pad(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Right-pad 1-D float tensors of different lengths into [B, T_max] (zeros)."""
    assert len(tensors) > 0, "cannot pad an empty micro-batch"
    return pad_sequence([t.to(device).float() for t in tensors], batch_first=True)


def batch_counts(batch: TrainBatch) -> GlobalCounts:
    """The global normalisers a `TrainBatch` carries (set by `make_train_batch`)."""
    return GlobalCounts(
        num_tokens=batch.num_global_tokens,
        num_seqs=batch.num_global_seqs,
        max_response_length=batch.max_response_length,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLoss:
    """The `LossFn` built from an `AlgorithmConfig`; `needs_*` tell a backend what to compute."""

    config: AlgorithmConfig

    @property
    def needs_entropy(self) -> bool:
        return self.config.entropy_coef != 0.0

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.config.kl_coef > 0.0 or self.config.policy_loss == "pairwise"

    @property
    def needs_values(self) -> bool:
        return self.config.advantage == "gae" and self.config.value_coef > 0.0

    def __call__(self, outputs: ModelOutputs, batch: TrainBatch) -> tuple[Any, dict[str, float]]:
        return policy_loss(self.config, outputs, batch)


def make_loss_fn(config: AlgorithmConfig) -> PolicyLoss:
    """The loss a backend calls per micro-batch (see the module docstring for the terms).

    With policy_loss = "pairwise" the batch must come from `pairwise.prepare_pairwise_batch`.
    """
    return PolicyLoss(config=config)


def _policy_terms(
    config: AlgorithmConfig, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask
) -> PolicyTerms:
    if config.policy_loss == "reinforce":
        return reinforce_loss(logp, adv)
    if config.policy_loss == "gspo":
        return gspo_loss(
            logp, old, adv, mask, eps_low=config.clip_eps_low, eps_high=config.clip_eps_high
        )
    if config.policy_loss == "cispo":
        return cispo_loss(
            logp, old, adv, eps_low=config.cispo_clip_eps_low, eps_high=config.cispo_clip_eps_high
        )
    assert config.policy_loss == "ppo", f"{config.policy_loss=}"
    return ppo_clip_loss(
        logp,
        old,
        adv,
        eps_low=config.clip_eps_low,
        eps_high=config.clip_eps_high,
        clip_ratio_c=config.clip_ratio_c,
    )


def policy_loss(
    config: AlgorithmConfig, outputs: ModelOutputs, batch: TrainBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss (globally normalised) and its additive metrics."""
    assert len(outputs.logprobs) == len(batch), f"{len(outputs.logprobs)=} != {len(batch)=}"
    assert batch.advantages, "TrainBatch.advantages is empty: build it with make_train_batch"
    logp = pad(outputs.logprobs)
    device = logp.device
    mask = pad(batch.loss_mask, device)
    adv = pad(batch.advantages, device)
    assert logp.shape == mask.shape, f"{logp.shape=} != {mask.shape=} (outputs vs batch)"
    old = pad(batch.old_logprobs, device) if batch.old_logprobs else logp.detach()
    counts = batch_counts(batch)
    if config.policy_loss == "pairwise":
        pg, metrics = pairwise_surrogate(logp, adv, mask, batch)
        metrics["pg_loss"] = float(pg.detach())
        metrics["ppo_kl"] = token_mean(old - logp.detach(), mask, counts)
        return _extra_terms(config, outputs, batch, logp, mask, counts, pg, metrics)
    terms = _policy_terms(config, logp, old, adv, mask)
    metrics: dict[str, float] = {}
    pg_per_token = _rollout_corrected(config, terms.loss, old, mask, batch, counts, metrics)
    pg = aggregate(pg_per_token, mask, config.loss_agg, counts)
    total = pg
    metrics |= _policy_metrics(terms, logp, old, mask, counts)
    metrics["pg_loss"] = float(pg.detach())
    if batch.rollout_logprobs:  # `old` is the training forward's own when none were given
        gap = (old - pad(batch.rollout_logprobs, device)).abs()
        metrics["logprob_mismatch"] = token_mean(gap, mask, counts)
    return _extra_terms(config, outputs, batch, logp, mask, counts, total, metrics)


def _rollout_corrected(config, pg_per_token, old, mask, batch, counts, metrics) -> torch.Tensor:
    """The per-token pg loss times TIS weights and the rejection keep-mask (when configured).

    Rejected tokens weigh 0 but the normalisers stay the batch's (masked importance sampling), so
    micro-batches still sum to the full batch's gradient.
    """
    if not config.tis and config.rollout_rs == "none":
        return pg_per_token
    if not batch.rollout_logprobs:
        raise ValueError(
            "algorithm.tis / algorithm.rollout_rs need TrainBatch.rollout_logprobs: the engine "
            "must return per-token logprobs for every sample (or set algorithm.tis = false and "
            "algorithm.rollout_rs = 'none')"
        )
    rollout = pad(batch.rollout_logprobs, mask.device)
    if config.tis:
        w = tis_weights(old, rollout, mask, cap=config.tis_cap, level=config.tis_level)
        pg_per_token = pg_per_token * w
        metrics["tis_weight_mean"] = token_mean(w, mask, counts)
        metrics["tis_truncated_frac"] = token_mean((w >= config.tis_cap).float(), mask, counts)
    if config.rollout_rs != "none":
        upper = config.rollout_rs_threshold
        lower = config.rollout_rs_threshold_lower or 1.0 / upper
        keep = rejection_keep_mask(
            old, rollout, mask, mode=config.rollout_rs, lower=lower, upper=upper
        )
        pg_per_token = pg_per_token * keep
        metrics["rollout_rs_dropped_frac"] = token_mean(mask - keep, mask, counts)
        has_tokens = (mask.sum(dim=-1) > 0).float()
        seq_dropped = ((mask - keep).sum(dim=-1) > 0).float()
        metrics["rollout_rs_dropped_seq_frac"] = seq_mean(seq_dropped, has_tokens, counts)
    return pg_per_token


def _extra_terms(config, outputs, batch, logp, mask, counts, total, metrics):
    """Entropy, KL-in-loss and value terms added to the policy term; the total and metrics."""
    if config.entropy_coef != 0.0:
        total = total + _entropy_term(config, outputs, mask, counts, metrics)
    elif outputs.entropy:  # a metric only: never in the graph (no backward through [N, V])
        entropy = pad([e.detach() for e in outputs.entropy], mask.device)
        metrics["entropy"] = token_mean(entropy, mask, counts)
    if config.kl_in == "loss" and config.kl_coef > 0.0:
        total = total + _kl_term(config, logp, batch, mask, counts, metrics)
    if config.advantage == "gae" and config.value_coef > 0.0:
        total = total + _value_term(config, outputs, batch, mask, counts, metrics)
    metrics["loss"] = float(total.detach())
    return total, metrics


def _policy_metrics(
    terms: PolicyTerms, logp: torch.Tensor, old: torch.Tensor, mask, counts: GlobalCounts
) -> dict[str, float]:
    return {
        "clipfrac": token_mean(terms.clipped, mask, counts),
        "clipfrac_high": token_mean(terms.clipped_high, mask, counts),
        "clipfrac_low": token_mean(terms.clipped_low, mask, counts),
        "dual_clipfrac": token_mean(terms.dual_clipped, mask, counts),
        "ppo_kl": token_mean(old - logp.detach(), mask, counts),
        "ratio_mean": token_mean(terms.ratio, mask, counts),
        "ratio_abs_dev": token_mean((terms.ratio - 1.0).abs(), mask, counts),
    }


def _entropy_term(config, outputs, mask, counts, metrics) -> torch.Tensor:
    if not outputs.entropy:
        raise ValueError(
            f"algorithm.entropy_coef = {config.entropy_coef} needs ModelOutputs.entropy: "
            "the backend must compute it (PolicyLoss.needs_entropy)"
        )
    entropy = pad(outputs.entropy, mask.device)
    agg = aggregate(entropy, mask, config.loss_agg, counts)
    metrics["entropy"] = token_mean(entropy, mask, counts)
    return -config.entropy_coef * agg


def _kl_term(config, logp, batch, mask, counts, metrics) -> torch.Tensor:
    if not batch.ref_logprobs:
        raise ValueError(
            f"algorithm.kl_coef = {config.kl_coef} with kl_in = 'loss' needs "
            "TrainBatch.ref_logprobs: compute them with the reference model first"
        )
    kl = config_kl(logp, pad(batch.ref_logprobs, logp.device), config)
    agg = aggregate(kl, mask, config.loss_agg, counts)
    metrics["kl"] = token_mean(kl, mask, counts)
    metrics["kl_loss"] = float(agg.detach())
    return config.kl_coef * agg


def _value_term(config, outputs, batch, mask, counts, metrics) -> torch.Tensor:
    if not outputs.values or not batch.returns or not batch.old_values:
        raise ValueError(
            "algorithm.advantage = 'gae' needs ModelOutputs.values and TrainBatch.returns / "
            "old_values (a critic); or set algorithm.value_coef = 0"
        )
    values = pad(outputs.values, mask.device)
    per_token, clipped = value_loss(
        values,
        pad(batch.old_values, mask.device),
        pad(batch.returns, mask.device),
        config.value_clip,
    )
    agg = aggregate(per_token, mask, config.loss_agg, counts)
    metrics["value_loss"] = float(agg.detach())
    metrics["value_clipfrac"] = token_mean(clipped, mask, counts)
    return config.value_coef * agg
