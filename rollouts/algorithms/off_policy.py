"""Off-policy correction against the engine's rollout logprobs: TIS, rejection, the mismatch.

The inference engine samples with slightly different numerics than the trainer (verl #2996), so
`logp_old` (trainer, before the update) and `logp_rollout` (engine) differ. Truncated importance
sampling multiplies each token's policy-gradient loss by w = min(exp(logp_old - logp_rollout), C),
DETACHED (a weight, not a path for gradients). Rejection (masked importance sampling, verl's
`rollout_rs` modes) instead drops the tokens, or whole sequences, whose engine-vs-trainer ratio
falls outside [lower, upper]. The mismatch metric is reported every step.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence

import torch

from rollouts.algorithms.losses import LOG_RATIO_CLAMP
from rollouts.config import RejectionMode


def tis_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    cap: float,
    level: str = "token",
) -> torch.Tensor:
    """Detached truncated IS weights [B, T] (as the reference sheet's TIS).

    token: w_t = min(exp(clamp(old_t - rollout_t, -20, 20)), cap).
    sequence: w_i = min(exp(clamp(sum_t M (old_t - rollout_t), -20, 20)), cap), on every token.
    Untrained positions get weight 0 (they are masked out of the loss anyway).
    """
    assert old_logp_BT.shape == rollout_logp_BT.shape == mask_BT.shape, f"{old_logp_BT.shape=}"
    assert cap >= 1.0, f"{cap=} must be >= 1"
    assert level in ("token", "sequence"), f"{level=} must be 'token' or 'sequence'"
    diff = (old_logp_BT.detach().float() - rollout_logp_BT.float()) * mask_BT
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True).expand_as(diff)
    log_w = torch.clamp(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.clamp(torch.exp(log_w), max=cap) * mask_BT).detach()


def logprob_mismatch(
    old_logprobs: Sequence[torch.Tensor],
    rollout_logprobs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
) -> float:
    """mean |logp_old - logp_rollout| over all trained tokens of a batch (0.0 when none)."""
    assert len(old_logprobs) == len(rollout_logprobs) == len(masks), f"{len(masks)=}"
    total, count = 0.0, 0.0
    for old, rollout, mask in zip(old_logprobs, rollout_logprobs, masks, strict=True):
        assert old.shape == rollout.shape == mask.shape, f"{old.shape=} {rollout.shape=}"
        total += float(((old.float() - rollout.float()).abs() * mask).sum())
        count += float(mask.sum())
    return total / count if count else 0.0


REJECTION_MODES = typing.get_args(RejectionMode)


def rejection_keep_mask(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: RejectionMode,
    lower: float,
    upper: float,
) -> torch.Tensor:
    """1 where a trained token is kept, 0 where rejected or untrained ([B, T], detached).

    The ratio is pi_trainer / pi_engine = exp(old - rollout) (verl `rollout_rs`):
    token: per token r_t; sequence: prod_t r_t = exp(sum_t log r_t); geometric: exp(mean_t log r_t)
    over the sequence's trained tokens. Outside [lower, upper] -> rejected (a sequence mode
    rejects every token of the sequence). Compared in log space, so no ratio overflows.
    """
    assert old_logp_BT.shape == rollout_logp_BT.shape == mask_BT.shape, f"{old_logp_BT.shape=}"
    assert mode in REJECTION_MODES[1:], f"{mode=} not in {REJECTION_MODES[1:]}"
    assert 0.0 <= lower < 1.0 < upper, f"need 0 <= {lower=} < 1 < {upper=}"
    log_r = (old_logp_BT.detach().float() - rollout_logp_BT.float()) * mask_BT
    if mode == "sequence":
        log_r = log_r.sum(dim=-1, keepdim=True).expand_as(log_r)
    elif mode == "geometric":
        n_B1 = mask_BT.sum(dim=-1, keepdim=True).clamp(min=1.0)
        log_r = (log_r.sum(dim=-1, keepdim=True) / n_B1).expand_as(log_r)
    log_lower = math.log(lower) if lower > 0.0 else -math.inf
    keep = (log_r >= log_lower) & (log_r <= math.log(upper))
    return (keep.float() * mask_BT).detach()
