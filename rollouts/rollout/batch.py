"""Pure batch-building functions of the rollout manager: kept groups become a `RolloutBatch`
with statistics; a short batch is explained; thrown-away work is counted.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.types import RolloutBatch, Sample, Status

Group = tuple[Sample, ...]


class ShortBatchError(RuntimeError):
    """Too few groups survived the filters within the over-sampling bound (on_short_batch=error)."""


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
    groups: Sequence[Sequence[Sample]],
    metadata: Mapping[str, Any],
    failed: Sequence[Sample] = (),
) -> RolloutBatch:
    """A RolloutBatch of kept groups (every sample finished and scored), with `failed`: FAILED
    samples of the groups it dropped, for the reports."""
    for group in groups:
        for s in group:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED), (
                f"sample {s.index}/{s.group_index} has status {s.status} in a batch"
            )
    return RolloutBatch(
        groups=tuple(tuple(g) for g in groups), metadata=dict(metadata), failed=tuple(failed)
    )


def short_batch_message(kept: int, target: int, rounds: int, dropped: Mapping[str, int]) -> str:
    """Why a batch is short, and what to change."""
    return (
        f"only {kept}/{target} groups kept after {rounds} over-sampling round(s) "
        f"(dropped: {dict(dropped)}); raise rollout.max_over_sampling_rounds or "
        "rollout.over_sampling_factor, or relax rollout.filters"
    )
