"""Build a `TrainBatch` from scored Samples and their per-token advantages.

Every per-token field is aligned with `sample.tokens`: position t holds the value for token t
(logprob of token t given tokens < t). The engine's `rollout_logprobs` (one per response token)
land on the response positions, prompt positions get 0. The global normalisers (trained tokens,
trained sequences, Dr.GRPO's T_max) are computed here over the WHOLE batch, before any split into
micro-batches or data-parallel shards, and `TrainBatch.select` keeps them on every part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollouts.algorithms.advantages import (
    PerToken,
    compute_advantages,
    compute_gae,
    needs_critic,
)
from rollouts.algorithms.aggregation import global_counts
from rollouts.algorithms.tensors import (
    buffer_views,
    flat_views,
    joined,
    long_views,
    mask_views,
    pack_at,
)
from rollouts.config import AlgorithmConfig
from rollouts.types import Sample, Status, TrainBatch

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


def rollout_logprobs_views(samples: Sequence[Sample]) -> tuple[torch.Tensor, ...]:
    """The engine's logprobs of each sample aligned with its tokens (prompt positions 0), as
    float32 views of one buffer, each sample's written at its response's place."""
    lengths = [len(s.tokens) for s in samples]
    raw = bytearray(4 * sum(lengths))
    start = 0
    for sample, length in zip(samples, lengths, strict=True):
        n = sample.response_length
        assert len(sample.rollout_logprobs) == n, (
            f"sample {sample.index}: {len(sample.rollout_logprobs)=} != {sample.response_length=}"
        )
        pack_at(raw, start + 4 * (length - n), "f", sample.rollout_logprobs)
        start += 4 * length
    return buffer_views(raw, torch.float32, lengths)


def teacher_top_tensors(sample: Sample, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(tokens), k] the teacher's top-k ids and logprobs at each response token's position
    (top-k distillation); prompt rows hold id 0 and logprob 0 (untrained)."""
    n = sample.response_length
    ids = torch.zeros((len(sample.tokens), k), dtype=torch.long)
    lps = torch.zeros((len(sample.tokens), k), dtype=torch.float32)
    if n:
        if len(sample.teacher_top) != n or any(len(step) != k for step in sample.teacher_top):
            raise ValueError(
                f"sample {sample.index} (group {sample.group_index}): top-k distillation needs "
                f"the teacher's {k} likeliest tokens at each of its {n} response tokens; it has "
                f"{len(sample.teacher_top)} positions"
            )
        ids[-n:] = torch.tensor([[t for t, _ in step] for step in sample.teacher_top])
        lps[-n:] = torch.tensor([[lp for _, lp in step] for step in sample.teacher_top])
    return ids, lps


def make_train_batch(
    samples: Sequence[Sample],
    advantages: Sequence[torch.Tensor],
    *,
    max_response_length: int = 0,
    returns: Sequence[torch.Tensor] = (),
    old_values: Sequence[torch.Tensor] = (),
    metadata: Mapping[str, Any] | None = None,
) -> TrainBatch:
    """A `TrainBatch` of `samples` (flat, in order) with their per-token `advantages`.

    `advantages[i]` is aligned with `samples[i].tokens` (what `compute_advantages` returns,
    flattened). `max_response_length` is Dr.GRPO's constant T_max (e.g. the sampling budget
    max_new_tokens); 0 = the longest response here. `rollout_logprobs` are included when every
    sample has them; the teacher's top-k when a sample has them (then every one must).
    `old_logprobs` / `ref_logprobs` are filled in later by the backend
    (`dataclasses.replace(batch, old_logprobs=...)`); the normalisers do not depend on them.
    """
    assert len(samples) == len(advantages), f"{len(samples)=} != {len(advantages)=}"
    assert not returns or len(returns) == len(samples), f"{len(returns)=} != {len(samples)=}"
    for sample, adv in zip(samples, advantages, strict=True):
        assert sample.status in TRAINABLE, (
            f"sample {sample.index} has status {sample.status.value}: only completed or truncated "
            "samples are trained on (drop FAILED / ABORTED ones first)"
        )
        assert adv.shape == (len(sample.tokens),), f"{adv.shape=} != ({len(sample.tokens)},)"
    # every per-token field is one buffer cut into per-sample views: built, masked and sent
    # (process_wire) in one op each, not one per sample
    lengths = [len(s.tokens) for s in samples]
    input_ids = long_views([s.tokens for s in samples])
    masks = mask_views([s.loss_mask for s in samples])
    advs = (
        flat_views(joined([a.float() for a in advantages]) * joined(masks), lengths)
        if samples
        else ()
    )
    with_rollout = bool(samples) and all(
        s.rollout_logprobs or not s.response_length for s in samples
    )
    longest = max((s.response_length for s in samples), default=0)
    counts = global_counts(masks, max_response_length or longest)
    k = next((len(s.teacher_top[0]) for s in samples if s.teacher_top), 0)
    top = [teacher_top_tensors(s, k) for s in samples] if k else []
    return TrainBatch(
        input_ids=input_ids,
        loss_mask=masks,
        advantages=advs,
        rollout_logprobs=rollout_logprobs_views(samples) if with_rollout else (),
        returns=tuple(r.float() for r in returns),
        old_values=tuple(v.float() for v in old_values),
        teacher_top_ids=tuple(ids for ids, _ in top),
        teacher_top_logprobs=tuple(lps for _, lps in top),
        num_global_tokens=counts.num_tokens,
        num_global_seqs=counts.num_seqs,
        max_response_length=counts.max_response_length,
        metadata=dict(metadata or {}),
    )


def flatten(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """Groups -> one flat list in order (samples, or the per-sample advantages of the groups)."""
    return [item for group in groups for item in group]


def nest(flat: Sequence[Any], groups: Sequence[Sequence[Any]]) -> tuple[tuple[Any, ...], ...]:
    """A flat per-sample list back into the nesting of `groups` (inverse of `flatten`)."""
    assert len(flat) == sum(len(g) for g in groups), f"{len(flat)=} != samples in groups"
    out, start = [], 0
    for group in groups:
        out.append(tuple(flat[start : start + len(group)]))
        start += len(group)
    return tuple(out)


def build_train_batch(
    groups: Sequence[Sequence[Sample]],
    config: AlgorithmConfig,
    *,
    token_rewards: PerToken | None = None,
    values: PerToken | None = None,
    max_response_length: int = 0,
) -> TrainBatch:
    """Advantages by `config` (see `compute_advantages`) and the `TrainBatch` of `groups`.

    With a critic's estimator (GAE) the critic's `values` are required, and returns / old_values are
    filled in for the value loss.
    """
    returns: Sequence[torch.Tensor] = ()
    old_values: Sequence[torch.Tensor] = ()
    if needs_critic(config):
        if values is None:
            raise ValueError("algorithm.advantage = 'gae' needs critic values: pass values=")
        adv, ret = compute_gae(groups, values, config, token_rewards)
        returns, old_values = flatten(ret), flatten(values)
    else:
        adv = compute_advantages(groups, config, token_rewards=token_rewards)
    return make_train_batch(
        flatten(groups),
        flatten(adv),
        max_response_length=max_response_length,
        returns=returns,
        old_values=old_values,
    )
