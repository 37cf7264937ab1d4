"""`make_loss_fn(config)`: the `LossFn` a training backend calls once per micro-batch.

total = policy term (`policy_loss.POLICY_LOSSES[config.policy_loss].term`)
        - entropy_coef * agg(entropy)
        + kl.coef * agg(kl(logp, logp_ref))   [kl.into = "loss"]
        + gae.value_coef * agg(value_loss)    [a critic's estimator, when the backend gives values]
        + distill.coef * agg(KL(teacher_K || student))   [distill.top_k: the teacher's top-K]
Every term is aggregated with `config.loss_agg` and the batch's GLOBAL counts, so a backend sums
the micro-batch losses' gradients (over micro-batches and data-parallel ranks: a backend whose
all-reduce AVERAGES gradients over DP ranks must multiply the loss by the world size). Metrics are
token means over the global N (or sums / global B), so they too are summed by the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rollouts.algorithms.aggregation import GlobalCounts, aggregate, token_mean
from rollouts.algorithms.algorithm import Algorithm
from rollouts.algorithms.kl import config_kl
from rollouts.algorithms.losses import value_loss
from rollouts.algorithms.policy_loss import policy_loss_of
from rollouts.algorithms.tensors import pad
from rollouts.config import AlgorithmConfig
from rollouts.types import ModelOutputs, TrainBatch


def batch_counts(batch: TrainBatch) -> GlobalCounts:
    """The global normalisers a `TrainBatch` carries (set by `make_train_batch`)."""
    return GlobalCounts(
        num_tokens=batch.num_global_tokens,
        num_seqs=batch.num_global_seqs,
        max_response_length=batch.max_response_length,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLLoss:
    """The `LossFn` of an `AlgorithmConfig`; `needs_*` tell a backend what to compute.

    It holds only the config (it crosses to a trainer process by pickle); the rest is looked up.
    """

    config: AlgorithmConfig

    @property
    def needs_entropy(self) -> bool:
        return Algorithm(config=self.config).needs_entropy

    @property
    def needs_values(self) -> bool:
        return Algorithm(config=self.config).needs_values

    def __call__(self, outputs: ModelOutputs, batch: TrainBatch) -> tuple[Any, dict[str, float]]:
        return policy_loss(self.config, outputs, batch)


def make_loss_fn(config: AlgorithmConfig) -> RLLoss:
    """The loss a backend calls per micro-batch (see the module docstring for the terms).

    A policy loss with a preparation (pairwise) needs its batch prepared first
    (`Algorithm.prepare`).
    """
    return RLLoss(config=config)


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
    term = policy_loss_of(config).term
    pg, metrics = term(config, logp, old, adv, mask, batch, counts)
    return _extra_terms(config, outputs, batch, logp, mask, counts, pg, metrics)


def _extra_terms(config, outputs, batch, logp, mask, counts, total, metrics):
    """Entropy, KL-in-loss and value terms added to the policy term; the total and metrics."""
    algorithm = Algorithm(config=config)
    if algorithm.needs_entropy:
        total = total + _entropy_term(config, outputs, mask, counts, metrics)
    elif outputs.entropy:  # a metric only: never in the graph (no backward through [N, V])
        entropy = pad([e.detach() for e in outputs.entropy], mask.device)
        metrics["entropy"] = token_mean(entropy, mask, counts)
    if algorithm.kl_in_loss:
        total = total + _kl_term(config, logp, batch, mask, counts, metrics)
    if algorithm.needs_values:
        total = total + _value_term(config, outputs, batch, mask, counts, metrics)
    if config.advantage == "distill" and config.distill.top_k:
        total = total + _top_k_term(config, outputs, batch, mask, counts, metrics)
    metrics["loss"] = float(total.detach())
    return total, metrics


def _entropy_term(config, outputs, mask, counts, metrics) -> torch.Tensor:
    if not outputs.entropy:
        raise ValueError(
            f"algorithm.entropy_coef = {config.entropy_coef} needs ModelOutputs.entropy: "
            "the backend must compute it (RLLoss.needs_entropy)"
        )
    entropy = pad(outputs.entropy, mask.device)
    agg = aggregate(entropy, mask, config.loss_agg, counts)
    metrics["entropy"] = token_mean(entropy, mask, counts)
    return -config.entropy_coef * agg


def _kl_term(config, logp, batch, mask, counts, metrics) -> torch.Tensor:
    if not batch.ref_logprobs:
        raise ValueError(
            f"algorithm.kl.coef = {config.kl.coef} with kl.into = 'loss' needs "
            "TrainBatch.ref_logprobs: compute them with the reference model first"
        )
    kl = config_kl(logp, pad(batch.ref_logprobs, logp.device), config.kl)
    agg = aggregate(kl, mask, config.loss_agg, counts)
    metrics["kl"] = token_mean(kl, mask, counts)
    metrics["kl_loss"] = float(agg.detach())
    return config.kl.coef * agg


def _value_term(config, outputs, batch, mask, counts, metrics) -> torch.Tensor:
    if not outputs.values or not batch.returns or not batch.old_values:
        raise ValueError(
            "algorithm.advantage = 'gae' needs ModelOutputs.values and TrainBatch.returns / "
            "old_values (a critic); or set algorithm.gae.value_coef = 0"
        )
    values = pad(outputs.values, mask.device)
    per_token, clipped = value_loss(
        values,
        pad(batch.old_values, mask.device),
        pad(batch.returns, mask.device),
        config.gae.value_clip,
    )
    agg = aggregate(per_token, mask, config.loss_agg, counts)
    metrics["value_loss"] = float(agg.detach())
    metrics["value_clipfrac"] = token_mean(clipped, mask, counts)
    return config.gae.value_coef * agg


def top_k_kl(teacher_BTK: torch.Tensor, student_BTK: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(teacher || student) over the teacher's K likeliest tokens: the teacher's K
    renormalised against the student's full-vocabulary logprobs of the same tokens. It is >= 0
    (the student's K sum to at most 1) and 0 only where the student puts all its mass on the
    K, in the teacher's proportions."""
    log_t = torch.log_softmax(teacher_BTK.float(), dim=-1)
    return (log_t.exp() * (log_t - student_BTK)).sum(-1)


def _top_k_term(config, outputs, batch, mask, counts, metrics) -> torch.Tensor:
    if not outputs.top_logprobs or not batch.teacher_top_logprobs:
        raise ValueError(
            f"algorithm.distill.top_k = {config.distill.top_k} needs the teacher's top-k on the "
            "batch (TrainBatch.teacher_top_*, from teacher-scored samples) and the backend's "
            "logprobs of them (ModelOutputs.top_logprobs)"
        )
    kl = top_k_kl(pad(batch.teacher_top_logprobs, mask.device), pad(outputs.top_logprobs))
    agg = aggregate(kl, mask, config.loss_agg, counts)
    metrics["top_k_kl"] = token_mean(kl, mask, counts)
    return config.distill.coef * agg
