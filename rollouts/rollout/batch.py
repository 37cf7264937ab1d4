"""Pure batch-building functions, and a synchronous batch iterator built from them.

The async manager and the synchronous path share these: scoring results are folded into
samples, groups are filtered, kept groups become a `RolloutBatch` with statistics.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rollouts.config import RolloutConfig
from rollouts.data.buffer import DataBuffer
from rollouts.rewards.scoring import as_reward
from rollouts.rollout.filters import run_filters
from rollouts.rollout.generate import fail_sample
from rollouts.rollout.planning import (
    Outcome,
    batch_outcome,
    groups_to_submit,
    new_round_state,
)
from rollouts.rollout.protocol import GroupFilter
from rollouts.types import Reward, RolloutBatch, Sample, Status

Group = tuple[Sample, ...]


class ShortBatchError(RuntimeError):
    """Too few groups survived the filters within the over-sampling bound (on_short_batch=error)."""


def check_reward(value: Any) -> Reward:
    """A reward function's value as a Reward (every real scalar, or a tuple of them: the rule of
    `rewards.scoring.as_reward`); anything else (None, str, NaN, inf, an array) is an error."""
    try:
        return as_reward(value)
    except TypeError as e:
        raise TypeError(f"reward function {e}") from e
    except ValueError as e:
        raise ValueError(f"reward function {e}") from e


def with_reward(sample: Sample, value: Any) -> Sample:
    """The sample with its reward set, or FAILED (error kept) when the value is not a reward."""
    try:
        return dataclasses.replace(sample, reward=check_reward(value))
    except (TypeError, ValueError) as e:
        return fail_sample(sample, f"reward_fn: {e}")


def score_group_sync(group: Sequence[Sample], reward_fn: Callable[[Sample], Any]) -> Group:
    """Score each finished sample; a raising reward fn marks that sample FAILED, never 0."""
    out = []
    for s in group:
        if s.status is Status.FAILED:
            out.append(s)
            continue
        try:
            value = reward_fn(s)
        except Exception as e:
            out.append(fail_sample(s, f"reward_fn raised {type(e).__name__}: {e}"))
            continue
        out.append(with_reward(s, value))
    return tuple(out)


def _as_filters(filter_fn: GroupFilter | Sequence[GroupFilter] | None) -> list[GroupFilter]:
    if filter_fn is None:
        return []
    return [filter_fn] if callable(filter_fn) else list(filter_fn)


def apply_sample_transforms(
    groups: Sequence[Sequence[Sample]],
    *,
    reward_fn: Callable[[Sample], Any] | None = None,
    filter_fn: GroupFilter | Sequence[GroupFilter] | None = None,
) -> tuple[list[Group], collections.Counter[str]]:
    """Score (sync `reward_fn`) then filter groups: (kept groups, drop counts by reason)."""
    filters = _as_filters(filter_fn)
    kept: list[Group] = []
    dropped: collections.Counter[str] = collections.Counter()
    for group in groups:
        scored = score_group_sync(group, reward_fn) if reward_fn else tuple(group)
        verdict = run_filters(scored, filters)
        if verdict.keep:
            kept.append(scored)
        else:
            dropped[verdict.reason] += 1
    return kept, dropped


def response_tokens(group: Sequence[Sample]) -> int:
    """The response tokens a group holds (generated in this batch or earlier ones)."""
    return sum(s.response_length for s in group)


def discarded_fraction(discarded_tokens: int, generated_tokens: int) -> float:
    """Tokens thrown away in a batch over the tokens generated in it, at most 1.

    Thrown-away work made in an earlier batch (a saved group dropped as too stale) counts in the
    batch that drops it, so over a run this is the share of generation wasted: with
    `over_sampling_factor = 2` in sync mode, where every saved surplus group goes stale, about
    half. At most 1 (a batch may drop more than it made: see the token counts).
    """
    assert discarded_tokens >= 0 and generated_tokens >= 0, (discarded_tokens, generated_tokens)
    if discarded_tokens == 0:
        return 0.0
    return min(discarded_tokens / generated_tokens, 1.0) if generated_tokens else 1.0


def compute_response_lengths(samples: Sequence[Sample]) -> list[int]:
    """Response tokens per sample (multi-turn: everything after the first prompt)."""
    return [s.response_length for s in samples]


def extract_sample_fields(samples: Sequence[Sample]) -> dict[str, list[Any]]:
    """Column view of samples: what the trainer needs, aligned by sample."""
    return {
        "tokens": [list(s.tokens) for s in samples],
        "loss_masks": [list(s.loss_mask) for s in samples],
        "rewards": [s.reward for s in samples],
        "rollout_logprobs": [list(s.rollout_logprobs) for s in samples],
        "response_lengths": compute_response_lengths(samples),
        "prompt_lengths": [s.prompt_length for s in samples],
        "weight_versions": [list(s.weight_versions) for s in samples],
        "statuses": [s.status.value for s in samples],
    }


def length_histogram(lengths: Sequence[int], num_bins: int = 8) -> dict[str, list[int]]:
    """Equal-width histogram of lengths: `edges` (num_bins + 1 ints) and `counts`."""
    assert num_bins >= 1, f"{num_bins=} must be >= 1"
    if not lengths:
        return {"edges": [], "counts": []}
    lo, hi = min(lengths), max(lengths)
    width = max(math.ceil((hi - lo + 1) / num_bins), 1)
    edges = [lo + i * width for i in range(num_bins + 1)]
    counts = [0] * num_bins
    for n in lengths:
        counts[min((n - lo) // width, num_bins - 1)] += 1
    return {"edges": edges, "counts": counts}


def build_batch_metadata(
    groups: Sequence[Group],
    *,
    dropped: Mapping[str, int],
    elapsed_s: float,
    generated_tokens: int,
    **extra: Any,
) -> dict[str, Any]:
    """Statistics of a batch: counts, drop reasons, lengths (histogram), time and tokens/s."""
    samples = [s for g in groups for s in g]
    lengths = compute_response_lengths(samples)
    statuses = collections.Counter(s.status.value for s in samples)
    return {
        "num_groups": len(groups),
        "num_samples": len(samples),
        "kept_groups": len(groups),
        "dropped_groups": sum(dropped.values()),
        "drop_reasons": dict(dropped),
        "statuses": dict(statuses),
        "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "response_length_max": max(lengths, default=0),
        "response_length_hist": length_histogram(lengths),
        "elapsed_s": elapsed_s,
        "generated_tokens": generated_tokens,
        "tokens_per_s": generated_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        **extra,
    }


def convert_to_batch(
    groups: Sequence[Sequence[Sample]], metadata: Mapping[str, Any]
) -> RolloutBatch:
    """A RolloutBatch of kept groups; every sample must be finished and scored."""
    for group in groups:
        for s in group:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED), (
                f"sample {s.index}/{s.group_index} has status {s.status} in a batch"
            )
    return RolloutBatch(groups=tuple(tuple(g) for g in groups), metadata=dict(metadata))


def _generate_group_sync(group: Sequence[Sample], generate: Callable[[Sample], Sample]) -> Group:
    out = []
    for s in group:
        try:
            out.append(generate(s))
        except Exception as e:
            out.append(fail_sample(s, f"generate_fn raised {type(e).__name__}: {e}"))
    return tuple(out)


def generate_rollout_batches(
    buffer: DataBuffer,
    generate: Callable[[Sample], Sample],
    config: RolloutConfig,
    *,
    reward_fn: Callable[[Sample], Any] | None = None,
    filters: Sequence[GroupFilter] = (),
    num_batches: int | None = None,
) -> Iterator[RolloutBatch]:
    """The synchronous path: generate, score and filter wave after wave until a batch is full.

    No aborts here (every submitted group finishes); surplus kept groups beyond the batch are
    dropped with reason "surplus". The over-sampling bound and `on_short_batch` apply as in
    the async manager.
    """
    made = 0
    while num_batches is None or made < num_batches:
        start = time.perf_counter()
        state = new_round_state(config.batch_size, config.over_sampling_factor)
        kept: list[Group] = []
        dropped: collections.Counter[str] = collections.Counter()
        while batch_outcome(state, config.max_over_sampling_rounds) is Outcome.CONTINUE:
            n = groups_to_submit(
                state, config.over_sampling_factor, config.max_over_sampling_rounds
            )
            groups = buffer.get_groups(n, config.n_samples_per_prompt)
            done = [_generate_group_sync(g, generate) for g in groups]
            new_kept, new_dropped = apply_sample_transforms(
                done, reward_fn=reward_fn, filter_fn=filters
            )
            kept += new_kept
            dropped += new_dropped
            state = dataclasses.replace(
                state,
                kept=len(kept),
                submitted=state.submitted + len(groups),
                exhausted=len(groups) < n,
            )
        if len(kept) > config.batch_size:
            dropped["surplus"] += len(kept) - config.batch_size
            kept = kept[: config.batch_size]
        short = len(kept) < config.batch_size
        if short and config.on_short_batch == "error":
            raise ShortBatchError(
                short_batch_message(len(kept), config.batch_size, state.rounds, dropped)
            )
        tokens = sum(s.response_length for g in kept for s in g)
        meta = build_batch_metadata(
            kept,
            dropped=dropped,
            elapsed_s=time.perf_counter() - start,
            generated_tokens=tokens,
            rounds=state.rounds,
            short_batch=short,
        )
        yield convert_to_batch(kept, meta)
        made += 1


def short_batch_message(kept: int, target: int, rounds: int, dropped: Mapping[str, int]) -> str:
    """Why a batch is short, and what to change."""
    return (
        f"only {kept}/{target} groups kept after {rounds} over-sampling round(s) "
        f"(dropped: {dict(dropped)}); raise rollout.max_over_sampling_rounds or "
        "rollout.over_sampling_factor, or relax rollout.filters"
    )
