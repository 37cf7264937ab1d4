"""Pairwise preference from groups: online DPO-style loss with beta against the reference model.

Each group of scored samples (one prompt) gives (chosen, rejected) pairs by a `PairSelector`.
Per pair, with S = sum over trained tokens of the logprob (policy), R = the same for the reference:
    Delta = (S_c - R_c) - (S_r - R_r) ;  L_pair = -log sigmoid(beta * Delta)
and the loss is the mean over ALL pairs of the (mini-)batch.

Micro-batching: a backend may put the two samples of a pair in different micro-batches, so the
loss is never computed from two sequences at once. Instead `prepare_pairwise_batch` computes, from
`TrainBatch.old_logprobs` (the policy before the update) and `ref_logprobs`, the gradient of L
w.r.t. each sample's S: dL/dS_c = -beta * sigmoid(-beta * Delta), dL/dS_r = +beta * sigmoid(...),
summed over the pairs a sample is in (0 when in none). It stores minus that coefficient (a
"pair advantage": positive for chosen) on every trained token of `TrainBatch.advantages`, and the
pair count in `metadata["num_pairs"]`. The per-micro-batch loss is then
    sum_i coef_i * S_i / num_pairs,
whose summed gradient is EXACTLY the gradient of the pairwise loss on the first update of a batch
(ppo_epochs = 1, one mini-batch: old logprobs = current parameters), and a first-order surrogate
of it on later updates (the coefficients are not recomputed). Its reported value is the exact
pairwise loss at the old logprobs (a straight-through constant), and pair accuracy (the share of
pairs with Delta > 0) and the pair count are reported too, as additive metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rollouts.config import AlgorithmConfig, PairwiseConfig
from rollouts.plugins import load_function
from rollouts.types import Sample, TrainBatch

Pair = tuple[int, int]  # (chosen, rejected) indices


class PairSelector(Protocol):
    """The (chosen, rejected) index pairs of one group of scored samples (indices into group)."""

    def __call__(self, group: Sequence[Sample]) -> list[tuple[int, int]]: ...


def group_rewards(group: Sequence[Sample]) -> list[float]:
    """The scalar rewards of a group; a missing or vector reward is an error naming the sample."""
    out = []
    for s in group:
        if s.reward is None or isinstance(s.reward, tuple):
            raise ValueError(
                f"sample {s.index} (group {s.group_index}) has reward {s.reward!r}: pairwise "
                "selection needs scalar rewards (set reward.weights or reward.transform = "
                "'pareto' for vector rewards)"
            )
        out.append(float(s.reward))
    return out


def best_vs_worst(group: Sequence[Sample], margin: float = 0.0) -> list[Pair]:
    """One pair: the first best sample vs the first worst; none if max - min <= margin."""
    assert margin >= 0.0, f"{margin=} must be >= 0"
    rewards = group_rewards(group)
    if not rewards or max(rewards) - min(rewards) <= margin:
        return []
    return [(rewards.index(max(rewards)), rewards.index(min(rewards)))]


def all_pairs_above_margin(margin: float = 0.0) -> PairSelector:
    """A selector of every (i, j) with r_i - r_j > margin, in order of i then j."""
    assert margin >= 0.0, f"{margin=} must be >= 0"

    def select(group: Sequence[Sample]) -> list[Pair]:
        r = group_rewards(group)
        n = len(r)
        return [(i, j) for i in range(n) for j in range(n) if r[i] - r[j] > margin]

    return select


def make_pair_selector(config: PairwiseConfig) -> Callable[[Sequence[Sample]], list[Pair]]:
    """The selector `config.selector` names: a built-in, or a user function by dotted path."""
    if config.selector == "best_vs_worst":
        return functools.partial(best_vs_worst, margin=config.margin)
    if config.selector == "all_pairs_above_margin":
        return all_pairs_above_margin(config.margin)
    return load_function(config.selector, PairSelector)


def select_pairs(
    groups: Sequence[Sequence[Sample]], selector: Callable[[Sequence[Sample]], list[Pair]]
) -> tuple[Pair, ...]:
    """All pairs of all groups as indices into the FLAT batch (groups in order), checked."""
    out: list[Pair] = []
    start = 0
    for number, group in enumerate(groups):
        pairs = selector(group)
        for pair in pairs:
            ok = (
                isinstance(pair, (tuple, list))
                and len(pair) == 2
                and all(isinstance(k, int) and 0 <= k < len(group) for k in pair)
                and pair[0] != pair[1]
            )
            if not ok:
                raise ValueError(
                    f"pair selector returned {pair!r} for group {number} of {len(group)} "
                    "samples: expected (chosen, rejected), two different indices into the group"
                )
            out.append((start + pair[0], start + pair[1]))
        start += len(group)
    return tuple(out)


def sequence_logprobs(logprobs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]):
    """S_i = sum_t mask_it * logp_it per sequence -> [B] float64."""
    assert len(logprobs) == len(masks), f"{len(logprobs)=} != {len(masks)=}"
    sums = [(lp.double() * m.double()).sum() for lp, m in zip(logprobs, masks, strict=True)]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)


def pair_deltas(pairs: Sequence[Pair], seq_logp: torch.Tensor, seq_ref: torch.Tensor):
    """Delta per pair = (S_c - R_c) - (S_r - R_r) -> [P] (differentiable in seq_logp)."""
    assert seq_logp.shape == seq_ref.shape, f"{seq_logp.shape=} != {seq_ref.shape=}"
    if not pairs:
        return seq_logp.new_zeros(0)
    chosen = torch.tensor([c for c, _ in pairs])
    rejected = torch.tensor([r for _, r in pairs])
    margin = seq_logp - seq_ref
    return margin[chosen] - margin[rejected]


def pairwise_loss(deltas: torch.Tensor, beta: float) -> torch.Tensor:
    """The mean over pairs of -log sigmoid(beta * Delta) (0 with no pair)."""
    assert beta > 0.0, f"{beta=} must be > 0"
    if deltas.numel() == 0:
        return deltas.new_zeros(())
    return torch.nn.functional.softplus(-beta * deltas).mean()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PairStats:
    """Per-sample gradient coefficients dL_sum/dS_i and the batch's pair loss and accuracy."""

    coefficients: tuple[float, ...]  # sum over pairs of dL_pair/dS_i (NOT divided by num_pairs)
    num_pairs: int
    loss: float  # mean over pairs of -log sigmoid(beta * Delta)
    accuracy: float  # share of pairs with Delta > 0


def pair_coefficients(
    pairs: Sequence[Pair], seq_old: torch.Tensor, seq_ref: torch.Tensor, beta: float
) -> PairStats:
    """dL/dS per sample at the old logprobs: chosen -beta*sigmoid(-beta*Delta), rejected +."""
    deltas = pair_deltas(pairs, seq_old.double(), seq_ref.double())
    weights = beta * torch.sigmoid(-beta * deltas)
    coef = [0.0] * len(seq_old)
    for (c, r), w in zip(pairs, weights.tolist(), strict=True):
        coef[c] -= w
        coef[r] += w
    n = len(pairs)
    return PairStats(
        coefficients=tuple(coef),
        num_pairs=n,
        loss=float(pairwise_loss(deltas, beta)),
        accuracy=float((deltas > 0).double().mean()) if n else 0.0,
    )


def prepare_pairwise_batch(
    batch: TrainBatch,
    groups: Sequence[Sequence[Sample]],
    config: AlgorithmConfig,
    selector: Callable[[Sequence[Sample]], list[Pair]] | None = None,
) -> TrainBatch:
    """The batch with pair advantages (-dL/dS_i on trained tokens) and the pair metadata.

    `batch` holds exactly the samples of `groups`, flat and in order, with `old_logprobs` and
    `ref_logprobs` filled in; the samples' rewards are final (shaped on the rollout side). Call it
    on each batch that is one optimizer step (each mini-batch, with its groups) so that
    `num_pairs` counts that step's pairs.
    """
    assert len(batch) == sum(len(g) for g in groups), f"{len(batch)=} != samples in groups"
    if not batch.old_logprobs or not batch.ref_logprobs:
        raise ValueError(
            "algorithm.policy_loss = 'pairwise' needs TrainBatch.old_logprobs and ref_logprobs "
            "(a reference model): compute both before prepare_pairwise_batch"
        )
    pairs = select_pairs(groups, selector or make_pair_selector(config.pairwise))
    stats = pair_coefficients(
        pairs,
        sequence_logprobs(batch.old_logprobs, batch.loss_mask),
        sequence_logprobs(batch.ref_logprobs, batch.loss_mask),
        config.pairwise.beta,
    )
    advantages = tuple(
        (-c) * m.float() for c, m in zip(stats.coefficients, batch.loss_mask, strict=True)
    )
    metadata = dict(batch.metadata) | {
        "num_pairs": stats.num_pairs,
        "pairwise_loss": stats.loss,
        "pair_accuracy": stats.accuracy,
    }
    return dataclasses.replace(batch, advantages=advantages, metadata=metadata)


def groups_of(groups: Sequence[Sequence[Sample]], indices: Sequence[int]) -> list[Sequence[Sample]]:
    """The groups whose samples are exactly the flat positions `indices` (a mini-batch)."""
    out, start, wanted = [], 0, set(indices)
    for group in groups:
        span = set(range(start, start + len(group)))
        assert span <= wanted or not span & wanted, f"indices split group at {start}: {indices=}"
        if span <= wanted:
            out.append(group)
        start += len(group)
    assert sum(len(g) for g in out) == len(indices), f"{indices=} outside the {start} samples"
    return out


def pairwise_surrogate(
    logp_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor, batch: TrainBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's pairwise loss: gradient sum_i coef_i dS_i / P, value = its pair-loss share.

    The value (and each metric) is the batch's figure times this micro-batch's share of the
    batch's trained tokens, so summing over micro-batches gives the batch's value.
    """
    assert logp_BT.shape == adv_BT.shape == mask_BT.shape, f"{logp_BT.shape=} {adv_BT.shape=}"
    if "num_pairs" not in batch.metadata:
        raise ValueError(
            "algorithm.policy_loss = 'pairwise': TrainBatch.metadata has no 'num_pairs'; the loop "
            "must call rollouts.algorithms.pairwise.prepare_pairwise_batch before training"
        )
    num_pairs = int(batch.metadata["num_pairs"])
    surrogate = -(adv_BT * mask_BT * logp_BT).sum() / max(num_pairs, 1)
    share = float(mask_BT.sum()) / max(batch.num_global_tokens, 1.0)
    loss_share = float(batch.metadata["pairwise_loss"]) * share
    value = surrogate - surrogate.detach() + loss_share
    assert math.isfinite(loss_share), f"{loss_share=} is not finite"
    metrics = {
        "pairwise_loss": loss_share,
        "pair_accuracy": float(batch.metadata["pair_accuracy"]) * share,
        "pairs": num_pairs * share,
    }
    return value, metrics
