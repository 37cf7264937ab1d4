"""Batches with nothing to train on: why, said on the console, and the error that stops a run
after several in a row.

Every sample of a batch can fail (a reward function that always times out, an engine that
answers errors), every group can be filtered out, or be too stale to train: the batch then
updates nothing, and it is not a step (`loops/rl_state.py`). Each such batch prints why (failed
samples, the filters' drop counts, stale groups, the first error), and `MAX_EMPTY_BATCHES` of
them in a row end the run with `NoUpdateError` (exit code 1), which names what to fix.
"""

from __future__ import annotations

from rollouts.types import RolloutBatch


class NoUpdateError(RuntimeError):
    """RL batches in a row updated nothing (the message says why and what to fix)."""


def empty_batch_reason(batch: RolloutBatch, stale_groups: int = 0) -> str | None:
    """Why `batch` has nothing to train on (`stale_groups` of its groups were too stale for
    the trainer); None when it has groups to train."""
    if batch.groups and stale_groups < len(batch.groups):
        return None
    meta = batch.metadata
    failed = int(meta.get("failed_samples", 0))
    drops = {k: v for k, v in dict(meta.get("drop_reasons", {})).items() if v}
    errors = [e for e in meta.get("errors", []) if e]
    parts = [f"{failed} sample(s) failed"] if failed else []
    if drops:
        parts.append(f"groups dropped by the filters: {drops}")
    if stale_groups:
        parts.append(f"{stale_groups} group(s) too stale to train (rollout.max_staleness)")
    first = f"; first error: {errors[0]}" if errors else ""
    return f"no trainable sample ({', '.join(parts) or 'no group was kept'}){first}"


def no_update_error(in_a_row: int, last_step: int, reason: str) -> NoUpdateError:
    """The error that stops a run after `in_a_row` batches that trained nothing."""
    return NoUpdateError(
        f"RL made no update in {in_a_row} batches in a row (after step {last_step}): the last "
        f"one had {reason}. Fix the cause (the reward function, rollout.reward_timeout_s, the "
        "engines, rollout.filters, rollout.max_staleness) and run again"
    )
