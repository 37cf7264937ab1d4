"""Failed samples say what failed (issue 45, parts 3 and 4), the pure parts: reasons and counts,
the console's lines, the held-out accuracy over the scored samples, the run's summary, and the
failed rows of rollouts.jsonl. The whole path, in a real run:
tests/training/test_reward_failures.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollouts.driver.evaluation import EvalFailedError, eval_result
from rollouts.driver.failures import batch_lines
from rollouts.driver.metrics import MetricsLogger
from rollouts.driver.summary import eval_failures_note, failure_summary
from rollouts.failures import (
    count_failures,
    counts_from_metrics,
    describe_counts,
    failed_in_group,
    failure_lines,
    failure_metrics,
    full_error,
    mark_failed,
    merge_counts,
)
from rollouts.loop.batch import rollout_metrics
from rollouts.rewards.scoring import score_sample
from rollouts.types import RolloutBatch, Sample, Status


def done(index: int, group: int = 0, reward: float | None = None) -> Sample:
    return Sample(
        index=index,
        group_index=group,
        prompt=f"{index}+1=",
        tokens=(1, 2, 3),
        loss_mask=(0, 1, 1),
        response_length=2,
        reward=reward,
        status=Status.COMPLETED,
    )


def picky(sample: Sample) -> object:
    """index % 4: 0 NaN, 1 raises, 2 a correct 1.0, 3 a wrong 0.0."""
    if sample.index % 4 == 1:
        raise ValueError(f"no label for {sample.index}")
    return (math.nan, None, 1.0, 0.0)[sample.index % 4]


async def scored(n: int) -> list[Sample]:
    return [await score_sample(done(i, group=i), picky, timeout_s=5.0) for i in range(n)]


async def test_each_failed_reward_has_its_reason_and_full_error() -> None:
    samples = await scored(4)
    assert [s.metadata.get("failure") for s in samples] == [
        "reward/non_finite",
        "reward/raised",
        None,
        None,
    ]
    assert count_failures(samples) == {"reward/non_finite": 1, "reward/raised": 1}
    place = failed_in_group(samples)[1]
    assert full_error(place) == (
        "group 1 sample 1, index 1: reward_fn tests.test_failures.picky raised "
        "ValueError: no label for 1"
    )
    assert "returned a non-finite reward nan" in full_error(samples[0])
    generated = mark_failed(done(7), "generate_fn pkg.gen raised OSError: x", "generate/raised")
    assert count_failures([generated]) == {"generate/raised": 1}


def test_failure_metrics_count_each_stage_and_reason() -> None:
    counts = {"reward/non_finite": 2, "reward/raised": 1, "generate/timed_out": 1}
    metrics = failure_metrics(counts, "rollout")
    assert metrics == {
        "rollout/reward_failed": 3.0,
        "rollout/reward_failed/non_finite": 2.0,
        "rollout/reward_failed/raised": 1.0,
        "rollout/generate_failed": 1.0,
        "rollout/generate_failed/timed_out": 1.0,
    }
    assert counts_from_metrics(metrics, "rollout") == dict(sorted(counts.items()))
    assert failure_metrics({}, "eval") == {"eval/reward_failed": 0.0, "eval/generate_failed": 0.0}
    assert describe_counts(counts) == "reward non_finite 2, generate timed_out 1, reward raised 1"
    # a step's line also counts the failures of the batches before it that trained nothing
    merged = merge_counts({"reward/raised": 1}, {"reward/raised": 2, "reward/timed_out": 1})
    assert merged == {"reward/raised": 3, "reward/timed_out": 1}
    meta = {"failures": {"reward/raised": 2}, "failed_samples": 2}
    assert rollout_metrics([], meta)["rollout/reward_failed/raised"] == 2.0


async def test_the_first_few_errors_of_each_reason_are_shown_in_full_then_counted() -> None:
    samples = failed_in_group(await scored(8))  # 2 NaN, 2 raise
    counts = count_failures(samples)
    first = failure_lines("step 1 rollouts", counts, samples, {}, max_full=1)
    assert (
        first.lines[0]
        == "step 1 rollouts: 4 sample(s) failed (reward non_finite 2, reward raised 2)"
    )
    assert len(first.lines) == 3  # one in full per reason
    assert first.lines[2].startswith("  reward failed at group 1 sample 1, index 1: reward_fn ")
    again = failure_lines("step 2 rollouts", counts, samples, first.shown, max_full=1)
    assert len(again.lines) == 1  # the counts alone once each reason was shown
    assert failure_lines("x", {}, [], {}).lines == ()


def test_a_steps_console_line_joins_failures_and_a_short_batch() -> None:
    bad = mark_failed(done(3, group=5), "reward_fn m.f raised KeyError: 'a'", "reward/raised")
    meta = {
        "failures": {"reward/raised": 1},
        "short_batch_message": "only 1/2 groups kept after 4 over-sampling round(s)",
    }
    batch = RolloutBatch(groups=((done(1, reward=1.0),),), metadata=meta, failed=(bad,))
    report = batch_lines(2, 2, batch, {})
    assert report.lines == (
        "step 2 rollouts: 1 sample(s) failed (reward raised 1); short batch: only 1/2 groups "
        "kept after 4 over-sampling round(s)",
        "  reward failed at group 5, index 3: reward_fn m.f raised KeyError: 'a'",
    )
    short = RolloutBatch(groups=(), metadata={"short_batch_message": "only 0/2"})
    assert batch_lines(1, 3, short, {}).lines == (
        "batch 3 rollouts (step 1): short batch: only 0/2",
    )
    assert batch_lines(1, 1, RolloutBatch(groups=()), {}).lines == ()


async def test_held_out_accuracy_is_over_the_scored_samples() -> None:
    result = eval_result(await scored(8))  # 4 failed, 2 of the 4 scored correct
    assert result.accuracy == 0.5  # was 2 / 8: a failed reward counted as a wrong answer
    assert (result.scored, result.failed, result.reward_mean) == (4, 4, 0.5)
    metrics = result.metrics()
    assert metrics["eval/failed"] == 4.0 and metrics["eval/scored"] == 4.0
    assert metrics["eval/reward_failed/non_finite"] == 2.0
    assert metrics["eval/reward_failed/raised"] == 2.0
    assert eval_failures_note(metrics) == (
        " (over the 4 scored samples; 4 failed: reward non_finite 2, reward raised 2)"
    )
    report = result.report()
    assert report[0] == (
        "held-out eval: 4 sample(s) failed (reward non_finite 2, reward raised 2); "
        "accuracy 0.500 over the 4 scored"
    )
    assert len(report) == 3 and "raised ValueError: no label for 1" in report[2]


async def test_an_evaluation_where_every_sample_failed_is_an_error_not_a_zero() -> None:
    samples = [s for s in await scored(8) if s.status is Status.FAILED]
    with pytest.raises(EvalFailedError) as info:
        eval_result(samples)
    message = str(info.value)
    assert message.startswith("every eval rollout failed: 4 sample(s) failed (reward ")
    assert (
        "first: group 0, index 0: reward_fn tests.test_failures.picky returned a non-finite"
        in message
    )
    assert "raised ValueError: no label for 1" in message


def test_the_summary_says_how_many_failed_and_why() -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.5, "eval/scored": 4.0, "eval/failed": 4.0,
         "eval/reward_failed/raised": 4.0},
        {"step": 1, "rollout/reward_failed": 3.0, "rollout/reward_failed/non_finite": 3.0},
        {"step": 2, "rollout/reward_failed": 1.0, "rollout/reward_failed/raised": 1.0,
         "eval/accuracy": 0.5, "eval/scored": 6.0, "eval/failed": 2.0,
         "eval/reward_failed/raised": 2.0},
    ]  # fmt: skip
    assert failure_summary(rows) == [
        "failed:     4 rollout sample(s) in 2 step(s) (reward non_finite 3, reward raised 1): "
        "never trained on; their errors are in rollouts.jsonl",
        "failed:     held-out at step 2 (over the 6 scored samples; 2 failed: reward raised 2)",
    ]
    assert failure_summary([{"step": 1, "rollout/reward_failed": 0.0}]) == []


def test_failed_samples_are_written_with_their_error(tmp_path: Path) -> None:
    logger = MetricsLogger([], tmp_path / "rollouts.jsonl")
    bad = mark_failed(
        done(3), "reward_fn m.f returned a non-finite reward nan", "reward/non_finite"
    )
    logger.log_samples(1, [done(1, reward=1.0), bad], decode=lambda ids: "x" * len(ids))
    rows = [json.loads(r) for r in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert "error" not in rows[0]
    assert rows[1]["status"] == "failed" and rows[1]["reward"] is None
    assert rows[1]["error"] == "reward_fn m.f returned a non-finite reward nan"
    assert rows[1]["failure"] == "reward/non_finite"
