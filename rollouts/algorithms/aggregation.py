"""Loss aggregation over tokens and sequences, normalised by the WHOLE batch's counts.

A per-token loss L [B, T] with mask M [B, T] is reduced to a scalar with one of four modes (the
definitions of verl's `agg_loss`, see /work/shared/reference/algorithms.md). Every denominator is a
count of the global batch (all micro-batches, all data-parallel ranks), never of the micro-batch,
so summing the gradients of the micro-batches gives the gradient of one big batch (TRL #3021).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rollouts.algorithms.tensors import row_sums
from rollouts.config import AGG_MODES, AggMode

SEQ_MEAN_EPS = 1e-8  # as in verl's seq-mean-token-mean


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GlobalCounts:
    """Normalisers of the whole batch: trained tokens N, trained sequences B, and T_max."""

    num_tokens: float
    num_seqs: float
    max_response_length: int

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0, f"{self.num_tokens=} must be >= 0"
        assert self.num_seqs >= 0, f"{self.num_seqs=} must be >= 0"
        assert self.max_response_length >= 0, f"{self.max_response_length=} must be >= 0"


def global_counts(masks: Sequence[torch.Tensor], max_response_length: int = 0) -> GlobalCounts:
    """Count trained tokens and sequences with any trained token over ALL sequences of a batch.

    `max_response_length` is Dr.GRPO's constant T_max; 0 means the longest trained span here.
    """
    sums = row_sums(masks)  # one segmented reduction, not three per sequence
    num_tokens = float(sum(sums))
    num_seqs = float(sum(1 for n in sums if n > 0))
    longest = max((int(n) for n in sums), default=0)
    return GlobalCounts(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_response_length=max_response_length or longest,
    )


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: AggMode, counts: GlobalCounts
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with `mode`, normalised by global `counts`.

    verl `agg_loss`'s names; the first three are its formulas, with N, B, T_max global:
    - token-mean:              sum(L*M) / N
    - seq-mean-token-sum:      sum_i [sum_t L*M] / B
    - seq-mean-token-mean:     sum_i [sum_t L*M / (sum_t M + 1e-8)] / B
    - seq-mean-token-sum-norm: sum(L*M) / (B * T_max)          (Dr.GRPO)
    Dr.GRPO differs from verl on purpose: verl divides by T alone (the padded length, or its
    `loss_scale_factor`), so its loss grows with the number of sequences in a micro-batch. We
    divide by B * T_max, as the Dr.GRPO paper's code (a constant normaliser per sequence, then
    the batch mean) and the reference sheet do: the scale is independent of the batch size, and
    with global B it stays exact under gradient accumulation. To get verl's, scale by B.
    A zero count gives a zero loss (the numerator is then zero too), never a NaN.
    """
    assert loss_BT.shape == mask_BT.shape, f"{loss_BT.shape=} != {mask_BT.shape=}"
    assert mode in AGG_MODES, f"{mode=} not in {AGG_MODES}"
    masked = loss_BT * mask_BT
    if mode == "token-mean":
        return masked.sum() / max(counts.num_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(counts.num_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / (mask_BT.sum(dim=-1) + SEQ_MEAN_EPS)
        return per_seq.sum() / max(counts.num_seqs, 1.0)
    denom = max(counts.num_seqs * counts.max_response_length, 1.0)
    return masked.sum() / denom


def token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor, counts: GlobalCounts) -> float:
    """A metric: sum(v*M) / N as a float, additive over micro-batches (global N)."""
    assert values_BT.shape == mask_BT.shape, f"{values_BT.shape=} != {mask_BT.shape=}"
    return float((values_BT.detach().float() * mask_BT).sum()) / max(counts.num_tokens, 1.0)


def seq_mean(values_B: torch.Tensor, has_tokens_B: torch.Tensor, counts: GlobalCounts) -> float:
    """A metric: the sum of per-sequence values over trained sequences / B (global B)."""
    assert values_B.shape == has_tokens_B.shape, f"{values_B.shape=} != {has_tokens_B.shape=}"
    total = float((values_B.detach().float() * has_tokens_B).sum())
    return total / max(counts.num_seqs, 1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / sqrt(var + eps) over masked entries, unbiased var (verl `masked_whiten`).

    Masked-out entries are returned as 0. With fewer than two entries the variance is taken as 0.
    """
    assert values.shape == mask.shape, f"{values.shape=} != {mask.shape=}"
    n = float(mask.sum())
    if n == 0:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / n
    centred = (values - mean) * mask
    var = (centred**2).sum() / (n - 1) if n > 1 else torch.zeros((), dtype=values.dtype)
    return centred * torch.rsqrt(var + eps) * mask
