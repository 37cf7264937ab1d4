"""Per-token policy losses (REINFORCE, PPO dual clip + clip-higher, GSPO, CISPO, truncated IS),
value, entropy.

Every function here works on padded [B, T] tensors and returns the UNAGGREGATED per-token loss
plus per-token indicator tensors for metrics; `aggregation.aggregate` reduces them with global
counts, and `loss_fn.make_loss_fn` wires everything behind the `LossFn` seam. Definitions follow
/work/shared/reference/algorithms.md (verl `compute_policy_loss_vanilla`, GSPO,
`compute_value_loss`).
"""

from __future__ import annotations

import dataclasses

import torch

LOG_RATIO_CLAMP = 20.0  # exp(clamp(logp - logp_old, -20, 20)), as verl
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the GSPO token log-ratio at 10


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyTerms:
    """A per-token policy loss and the per-token facts its metrics are built from ([B, T] each)."""

    loss: torch.Tensor
    ratio: torch.Tensor  # detached importance ratio used by the loss
    clipped: torch.Tensor  # 1 where the clipped objective was the active one (verl pg_clipfrac)
    clipped_high: torch.Tensor  # 1 where A > 0 and ratio > 1 + eps_high
    clipped_low: torch.Tensor  # 1 where A < 0 and ratio < 1 - eps_low
    dual_clipped: torch.Tensor  # 1 where A < 0 and the dual clip -A*c bounded the loss


def _zeros(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float32)


def reinforce_loss(logp_BT: torch.Tensor, adv_BT: torch.Tensor) -> PolicyTerms:
    """Plain policy gradient (score function): l_t = -A_t * logp_t; ratio reported as 1."""
    assert logp_BT.shape == adv_BT.shape, f"{logp_BT.shape=} != {adv_BT.shape=}"
    zeros = _zeros(logp_BT)
    return PolicyTerms(
        loss=-adv_BT * logp_BT,
        ratio=torch.ones_like(zeros),
        clipped=zeros,
        clipped_high=zeros,
        clipped_low=zeros,
        dual_clipped=zeros,
    )


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float,
) -> PolicyTerms:
    """PPO clip with dual clip and separate low/high clip, as verl `compute_policy_loss_vanilla`.

    r = exp(clamp(logp - old, -20, 20)); l1 = -A r; l2 = -A clamp(r, 1-eps_low, 1+eps_high);
    l_clip = max(l1, l2); for A < 0: min(-A c, l_clip) (dual clip). DAPO clip-higher: eps_high=0.28.
    """
    assert logp_BT.shape == old_logp_BT.shape == adv_BT.shape, f"{logp_BT.shape=}"
    assert clip_ratio_c > 1.0, f"{clip_ratio_c=} must be > 1 (dual clip)"
    ratio = torch.exp(torch.clamp(logp_BT - old_logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clipped_terms(ratio, adv_BT, eps_low, eps_high, clip_ratio_c)


def _clipped_terms(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, c: float | None
) -> PolicyTerms:
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    l_clip = torch.maximum(l1, l2)
    r = ratio.detach()
    clipped_high = ((adv > 0) & (r > 1.0 + eps_high)).float()
    clipped_low = ((adv < 0) & (r < 1.0 - eps_low)).float()
    if c is None:  # no dual clip
        loss, dual_clipped = l_clip, _zeros(r)
    else:
        l3 = -adv * c
        loss = torch.where(adv < 0, torch.minimum(l3, l_clip), l_clip)
        dual_clipped = ((l_clip > l3) & (adv < 0)).float()
    return PolicyTerms(
        loss=loss,
        ratio=r,
        clipped=(l2 > l1).float(),
        clipped_high=clipped_high,
        clipped_low=clipped_low,
        dual_clipped=dual_clipped,
    )


def gspo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> PolicyTerms:
    """GSPO: the sequence ratio s_i = exp(mean_t(logp - old)) over trained tokens, clipped.

    Attached to each token straight-through: s_it = sg(s_i) * exp(logp_t - sg(logp_t)), so the
    value is s_i and the gradient flows per token; then PPO's clipped objective (no dual clip).
    Aggregate with seq-mean-token-mean (the GSPO definition; the config enforces it).
    """
    assert logp_BT.shape == old_logp_BT.shape == adv_BT.shape == mask_BT.shape, f"{logp_BT.shape=}"
    n_B = mask_BT.sum(dim=-1).clamp(min=1.0)
    seq_log_ratio_B = ((logp_BT - old_logp_BT) * mask_BT).sum(dim=-1) / n_B
    log_s = seq_log_ratio_B.detach().unsqueeze(-1) + logp_BT - logp_BT.detach()
    ratio = torch.exp(torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX))
    return _clipped_terms(ratio, adv_BT, eps_low, eps_high, None)


def cispo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> PolicyTerms:
    """CISPO (MiniMax-M1): l_t = -sg(clamp(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t.

    The importance weight is clipped and DETACHED, so every token keeps its REINFORCE gradient
    (scaled by the weight); the PPO clip would drop the gradient of tokens past 1 +- eps instead.
    eps_low = 1 (the default) puts no lower bound on the weight, as the paper. `clipped` marks
    tokens whose weight was clipped (they are still trained).
    """
    assert logp_BT.shape == old_logp_BT.shape == adv_BT.shape, f"{logp_BT.shape=}"
    assert 0.0 <= eps_low <= 1.0, f"{eps_low=} must be in [0, 1]"
    log_ratio = torch.clamp(logp_BT.detach() - old_logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    high = (ratio > 1.0 + eps_high).float()
    low = (ratio < 1.0 - eps_low).float()
    return PolicyTerms(
        loss=-weight * adv_BT * logp_BT,
        ratio=ratio,
        clipped=torch.maximum(high, low),
        clipped_high=high * (adv_BT > 0).float(),
        clipped_low=low * (adv_BT < 0).float(),
        dual_clipped=_zeros(ratio),
    )


def truncated_is_loss(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, *, cap: float
) -> PolicyTerms:
    """Truncated importance-sampling policy gradient: l_t = -sg(min(r_t, cap)) * A_t * logp_t.

    r_t = exp(clamp(logp_t - old_t, -20, 20)) and its truncation at `cap` are the reference sheet's
    TIS weight (C = 2.0 there), here for the update's own ratio pi / pi_old: the off-policy policy
    gradient min(r, C) A grad(logp), with the weight DETACHED and no PPO clip, so every token keeps
    its gradient and only its weight is bounded (above: no lower bound). The same as CISPO with
    eps_low = 1 and eps_high = cap - 1. `clipped` marks tokens whose weight was truncated.
    """
    assert logp_BT.shape == old_logp_BT.shape == adv_BT.shape, f"{logp_BT.shape=}"
    assert cap >= 1.0, f"{cap=} must be >= 1"
    log_ratio = torch.clamp(logp_BT.detach() - old_logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    truncated = (ratio > cap).float()
    return PolicyTerms(
        loss=-torch.clamp(ratio, max=cap) * adv_BT * logp_BT,
        ratio=ratio,
        clipped=truncated,
        clipped_high=truncated * (adv_BT > 0).float(),
        clipped_low=_zeros(ratio),
        dual_clipped=_zeros(ratio),
    )


def value_loss(
    values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (verl `compute_value_loss`), and its clip indicator.

    v_clip = clamp(v, old - clip, old + clip); l = 0.5 * max((v - R)^2, (v_clip - R)^2); the
    indicator is verl's vf_clipfrac, (v_clip - R)^2 > (v - R)^2. v_clip is a clamp of v itself
    (not old + clamp(v - old)), so an unclipped value is bit-identical to v and rounding never
    counts it as clipped.
    """
    assert values_BT.shape == old_values_BT.shape == returns_BT.shape, f"{values_BT.shape=}"
    assert clip > 0, f"{clip=} must be > 0"
    old = old_values_BT.detach()
    v_clipped = torch.clamp(values_BT, old - clip, old + clip)
    l1 = (values_BT - returns_BT) ** 2
    l2 = (v_clipped - returns_BT) ** 2
    return 0.5 * torch.maximum(l1, l2), (l2 > l1).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) * z)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
