"""Failed samples and short batches, said as the project says bad data lines: on the console, one
line per step with the counts by reason, and below it the first few errors of each reason in full
(the function's dotted name, the sample's group and index, the exception or the value returned);
in rollouts.jsonl, every failed sample a batch carries, with its status, error and reason.

The words are decided by pure functions (`batch_lines`, `rollouts.failures`); `BatchReporter`
only keeps how many errors of each reason the run has shown, prints, and writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from rollouts.driver.metrics import MetricsLogger
from rollouts.failures import FailureLines, failure_lines
from rollouts.types import RolloutBatch


def batch_lines(
    step: int, number: int, batch: RolloutBatch, shown: Mapping[str, int]
) -> FailureLines:
    """'step 3 rollouts: 4 sample(s) failed (reward non_finite 2, ...); short batch: only 1/2
    groups kept ...' (one line; none when nothing failed and the batch is whole; 'batch 4
    rollouts (step 3)' once batches that trained nothing made the numbers differ), then the
    errors of reasons shown fewer than `MAX_FULL_ERRORS` times in this run, in full."""
    meta = batch.metadata
    head = f"step {step} rollouts" if number == step else f"batch {number} rollouts (step {step})"
    report = failure_lines(head, dict(meta.get("failures", {})), batch.failed, shown)
    short = str(meta.get("short_batch_message", ""))
    if not short:
        return report
    if not report.lines:
        return dataclasses.replace(report, lines=(f"{head}: short batch: {short}",))
    first, *rest = report.lines
    return dataclasses.replace(report, lines=(f"{first}; short batch: {short}", *rest))


@dataclasses.dataclass(kw_only=True, slots=True)
class BatchReporter:
    """The RL loop's `report_batch` hook: each batch's failures on the console, and its sampled
    rows (`logging.rollouts_per_step`) plus every failed sample it carries in rollouts.jsonl."""

    logger: MetricsLogger
    decode: Callable[[list[int]], str]
    rows_per_step: int
    shown: dict[str, int] = dataclasses.field(default_factory=dict)  # full errors per reason

    def __call__(self, step: int, number: int, batch: RolloutBatch) -> None:
        """Report batch `number`, which trains as step `step` (or trains nothing)."""
        assert step >= 1, f"{step=}: a batch trains as step 1 or later"
        assert number >= step, f"batch {number=} before {step=}: a step is a trained batch"
        report = batch_lines(step, number, batch, self.shown)
        self.shown = dict(report.shown)
        for line in report.lines:
            print(f"[train] {line}", flush=True)
        rows = [*batch.samples[: self.rows_per_step], *batch.failed]
        self.logger.log_samples(step, rows, self.decode)
