"""The policy losses by name (`POLICY_LOSSES`): each one's term of the loss and what it needs.

A `PolicyLoss` is a record, not a class to subclass: its `term` is the policy part of one
micro-batch's loss (aggregated with the batch's global counts, plus its additive metrics), and its
flags say what the loop must provide: a reference model, old logprobs from a pass of their own
before the update, a per-step preparation of the batch (pairwise: the pairs' coefficients).
A per-token loss (PPO, REINFORCE, GSPO, CISPO, truncated IS) is `per_token(terms)`: its
`PolicyTerms` are corrected for the engine-vs-trainer mismatch (TIS weights, rejection) and
aggregated with `config.loss_agg`. Adding a loss: its per-token terms (`losses.py`), one entry
here, its name in the config's `PolicyLossName` and its keys in a sub-table of [algorithm].
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence

import torch

from rollouts.algorithms.aggregation import GlobalCounts, aggregate, seq_mean, token_mean
from rollouts.algorithms.losses import (
    PolicyTerms,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    truncated_is_loss,
)
from rollouts.algorithms.off_policy import rejection_keep_mask, tis_weights
from rollouts.algorithms.pairwise import pairwise_surrogate, prepare_pairwise_batch
from rollouts.algorithms.tensors import pad
from rollouts.config import AlgorithmConfig
from rollouts.config.algorithm import PolicyLossName
from rollouts.types import Sample, TrainBatch

Metrics = dict[str, float]
# (config, logp, old, adv, mask, batch, counts) -> (aggregated policy loss, additive metrics)
TermFn = Callable[..., tuple[torch.Tensor, Metrics]]
# (config, logp, old, adv, mask) -> the per-token loss and its indicators
TermsFn = Callable[..., PolicyTerms]
PrepareFn = Callable[[TrainBatch, Sequence[Sequence[Sample]], AlgorithmConfig], TrainBatch]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLoss:
    """One policy loss: its term of the loss and what the loop must give it."""

    name: str
    term: TermFn
    needs_reference: bool = False  # its term compares against the reference model
    needs_old_logprobs: bool = False  # before the update, even on-policy (a pass of their own)
    prepare: PrepareFn | None = None  # per optimizer step, before the forward (its own groups)


def per_token(terms_fn: TermsFn) -> TermFn:
    """The term of a per-token loss: TIS / rejection-corrected, aggregated by `loss_agg`."""

    def term(config, logp, old, adv, mask, batch: TrainBatch, counts: GlobalCounts):
        terms = terms_fn(config, logp, old, adv, mask)
        metrics: Metrics = {}
        pg_per_token = _rollout_corrected(config, terms.loss, old, mask, batch, counts, metrics)
        pg = aggregate(pg_per_token, mask, config.loss_agg, counts)
        metrics |= _policy_metrics(terms, logp, old, mask, counts)
        metrics["pg_loss"] = float(pg.detach())
        if batch.rollout_logprobs:  # `old` is the training forward's own when none were given
            gap = (old - pad(batch.rollout_logprobs, mask.device)).abs()
            metrics["logprob_mismatch"] = token_mean(gap, mask, counts)
        return pg, metrics

    return term


def _rollout_corrected(config, pg_per_token, old, mask, batch, counts, metrics) -> torch.Tensor:
    """The per-token pg loss times TIS weights and the rejection keep-mask (when configured).

    Rejected tokens weigh 0 but the normalisers stay the batch's (masked importance sampling), so
    micro-batches still sum to the full batch's gradient.
    """
    correction = config.rollout_correction
    if not correction.enabled:
        return pg_per_token
    if not batch.rollout_logprobs:
        raise ValueError(
            "algorithm.rollout_correction (tis, rejection) needs TrainBatch.rollout_logprobs: the "
            "engine must return per-token logprobs for every sample (or set "
            "algorithm.rollout_correction.tis = false and rejection = 'none')"
        )
    rollout = pad(batch.rollout_logprobs, mask.device)
    if correction.tis:
        cap = correction.tis_cap
        w = tis_weights(old, rollout, mask, cap=cap, level=correction.tis_level)
        pg_per_token = pg_per_token * w
        metrics["tis_weight_mean"] = token_mean(w, mask, counts)
        metrics["tis_truncated_frac"] = token_mean((w >= cap).float(), mask, counts)
    if correction.rejection != "none":
        upper = correction.rejection_threshold
        lower = correction.rejection_threshold_lower or 1.0 / upper
        keep = rejection_keep_mask(
            old, rollout, mask, mode=correction.rejection, lower=lower, upper=upper
        )
        pg_per_token = pg_per_token * keep
        metrics["rollout_rs_dropped_frac"] = token_mean(mask - keep, mask, counts)
        has_tokens = (mask.sum(dim=-1) > 0).float()
        seq_dropped = ((mask - keep).sum(dim=-1) > 0).float()
        metrics["rollout_rs_dropped_seq_frac"] = seq_mean(seq_dropped, has_tokens, counts)
    return pg_per_token


def _policy_metrics(terms: PolicyTerms, logp, old, mask, counts: GlobalCounts) -> Metrics:
    return {
        "clipfrac": token_mean(terms.clipped, mask, counts),
        "clipfrac_high": token_mean(terms.clipped_high, mask, counts),
        "clipfrac_low": token_mean(terms.clipped_low, mask, counts),
        "dual_clipfrac": token_mean(terms.dual_clipped, mask, counts),
        "ppo_kl": token_mean(old - logp.detach(), mask, counts),
        "ratio_mean": token_mean(terms.ratio, mask, counts),
        "ratio_abs_dev": token_mean((terms.ratio - 1.0).abs(), mask, counts),
    }


def _ppo(config: AlgorithmConfig, logp, old, adv, mask) -> PolicyTerms:
    return ppo_clip_loss(
        logp,
        old,
        adv,
        eps_low=config.clip_eps_low,
        eps_high=config.clip_eps_high,
        clip_ratio_c=config.clip_ratio_c,
    )


def _reinforce(config: AlgorithmConfig, logp, old, adv, mask) -> PolicyTerms:
    return reinforce_loss(logp, adv)


def _gspo(config: AlgorithmConfig, logp, old, adv, mask) -> PolicyTerms:
    return gspo_loss(
        logp, old, adv, mask, eps_low=config.clip_eps_low, eps_high=config.clip_eps_high
    )


def _cispo(config: AlgorithmConfig, logp, old, adv, mask) -> PolicyTerms:
    return cispo_loss(
        logp, old, adv, eps_low=config.cispo.clip_eps_low, eps_high=config.cispo.clip_eps_high
    )


def _truncated_is(config: AlgorithmConfig, logp, old, adv, mask) -> PolicyTerms:
    return truncated_is_loss(logp, old, adv, cap=config.truncated_is.cap)


def _pairwise(config, logp, old, adv, mask, batch: TrainBatch, counts: GlobalCounts):
    """The pairwise preference surrogate (`pairwise.pairwise_surrogate`; loss_agg unused)."""
    pg, metrics = pairwise_surrogate(logp, adv, mask, batch)
    metrics["pg_loss"] = float(pg.detach())
    metrics["ppo_kl"] = token_mean(old - logp.detach(), mask, counts)
    return pg, metrics


POLICY_LOSSES: dict[str, PolicyLoss] = {
    loss.name: loss
    for loss in (
        PolicyLoss(name="ppo", term=per_token(_ppo)),
        PolicyLoss(name="reinforce", term=per_token(_reinforce)),
        PolicyLoss(name="gspo", term=per_token(_gspo)),
        PolicyLoss(name="cispo", term=per_token(_cispo)),
        PolicyLoss(name="truncated_is", term=per_token(_truncated_is)),
        PolicyLoss(
            name="pairwise",
            term=_pairwise,
            needs_reference=True,  # beta * (policy - reference) margins
            needs_old_logprobs=True,  # the pairs' coefficients, before the forward
            prepare=prepare_pairwise_batch,
        ),
    )
}
assert set(POLICY_LOSSES) == set(typing.get_args(PolicyLossName)), (
    f"{sorted(POLICY_LOSSES)=} != the config's {typing.get_args(PolicyLossName)}"
)


def policy_loss_of(config: AlgorithmConfig) -> PolicyLoss:
    """The policy loss `config.policy_loss` names."""
    return POLICY_LOSSES[config.policy_loss]
