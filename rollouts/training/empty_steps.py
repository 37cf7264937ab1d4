"""RL steps with nothing to train on, said on the console, and a run that made no update at all
is an error.

Every sample of a batch can fail (a reward function that always times out, an engine that
answers errors): the batch then has no group, the step trains nothing, and a run of one such
step used to exit 0 with a checkpoint of its starting weights and no word on the console. Now
each such step prints why (failed samples, the filters' drop counts, the first error), and a run
whose steps made no update ends with `NoUpdateError` (exit code 1) that says so.
"""

from __future__ import annotations

import dataclasses

from rollouts.types import RolloutBatch


class NoUpdateError(RuntimeError):
    """RL ran steps but none of them updated the weights (the message says why)."""


def empty_batch_reason(batch: RolloutBatch) -> str | None:
    """Why `batch` has nothing to train on; None when it has groups."""
    if batch.groups:
        return None
    meta = batch.metadata
    failed = int(meta.get("failed_samples", 0))
    drops = {k: v for k, v in dict(meta.get("drop_reasons", {})).items() if v}
    errors = [e for e in meta.get("errors", []) if e]
    parts = [f"{failed} sample(s) failed"] if failed else []
    if drops:
        parts.append(f"groups dropped by the filters: {drops}")
    first = f"; first error: {errors[0]}" if errors else ""
    return f"no trainable sample ({', '.join(parts) or 'no group was kept'}){first}"


@dataclasses.dataclass(kw_only=True, slots=True)
class EmptySteps:
    """The RL steps whose batch had nothing to train on, and why the last one had nothing."""

    steps: list[int] = dataclasses.field(default_factory=list)
    last_reason: str = ""

    def see(self, step: int, batch: RolloutBatch) -> None:
        """Note `step`'s batch; an empty one is said on the console, with why."""
        reason = empty_batch_reason(batch)
        if reason is None:
            return
        self.steps.append(step)
        self.last_reason = reason
        print(f"[train] RL step {step}: {reason}", flush=True)

    def check_updated(self, start_step: int, end_step: int, updated: bool) -> None:
        """NoUpdateError when steps `start_step + 1 .. end_step` ran and none updated."""
        if updated or end_step <= start_step:
            return
        n = end_step - start_step
        why = self.last_reason or "every batch was dropped before training (too stale?)"
        raise NoUpdateError(
            f"RL made no update in {n} step(s) (steps {start_step + 1}-{end_step}): the last "
            f"one had {why}. The checkpoint of step {end_step} holds the weights the run "
            "started from; fix the cause (the reward function, rollout.reward_timeout_s, the "
            "engines, rollout.filters) and run again"
        )
