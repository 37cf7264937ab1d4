"""Why samples failed: one reason per FAILED sample, counts by reason, and the words that say so.

A sample fails in one of three stages: its generation (the generate function, the environment or
the engines it reaches), its scoring (the reward function) or, in on-policy distillation, the
teacher's scoring of its tokens. Where it fails, `mark_failed`
records both in the sample's metadata: `error`, the whole message (the function's dotted name,
then the exception with its type and message, or the value it returned), and `failure`, its
reason (`FailureReason`, e.g. "reward/non_finite"). Reports read them back as the data loaders
report bad lines: the first few errors in full, each with the sample's group and index, then
counts by reason. All of it is pure; the driver prints and logs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

from rollouts.types import Sample, Status

FailureReason = Literal[
    "reward/raised",  # the reward function raised
    "reward/timed_out",  # ... ran past rollout.reward_timeout_s
    "reward/non_finite",  # ... returned NaN or an infinity
    "reward/not_a_reward",  # ... returned None, a string, an array, ...
    "reward/unparsed",  # a judge's answer held no score (or one out of its range)
    "generate/raised",  # the generate function (or the environment inside it) raised
    "generate/timed_out",  # ... ran past rollout.generate_timeout_s (or env_timeout_s)
    "generate/no_room",  # the prompt leaves no room for a token under max_total_tokens
    "generate/aborted",  # an evaluation rollout aborted every time it was tried
    "generate/engine_error",  # the engine answered an error (evaluation)
    "generate/failed",  # a generate function returned the sample FAILED itself
    "teacher/engine_error",  # the teacher's engine answered an error
]
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)
STAGES = ("reward", "generate", "teacher")
OPTIONAL_STAGES = ("teacher",)  # in metrics only when a sample failed there
MAX_FULL_ERRORS = 3  # errors shown in full per reason (a run's console, an evaluation)


def mark_failed(sample: Sample, error: str, reason: FailureReason) -> Sample:
    """The sample FAILED, its reward cleared, `error` and `reason` kept in its metadata."""
    assert reason in FAILURE_REASONS, f"{reason=} is not one of {FAILURE_REASONS}"
    assert error, f"a failure of sample {sample.group_index}/{sample.index} needs an error"
    metadata = {**sample.metadata, "error": error, "failure": reason}
    return dataclasses.replace(sample, status=Status.FAILED, reward=None, metadata=metadata)


def failure_reason(sample: Sample) -> str:
    """Why a FAILED sample failed (a user generate function's own FAILED: "generate/failed")."""
    assert sample.status is Status.FAILED, f"sample {sample.index} is {sample.status}, not FAILED"
    reason = str(sample.metadata.get("failure", "generate/failed"))
    return reason if reason in FAILURE_REASONS else "generate/failed"


def count_failures(samples: Iterable[Sample]) -> dict[str, int]:
    """{reason: FAILED samples} over `samples` (the others are not counted)."""
    counts = collections.Counter(failure_reason(s) for s in samples if s.status is Status.FAILED)
    return dict(sorted(counts.items()))


def failure_metrics(counts: Mapping[str, int], prefix: str) -> dict[str, float]:
    """`{prefix}/reward_failed`, `{prefix}/generate_failed` (always) and one key per reason
    seen (`{prefix}/reward_failed/non_finite`), for metrics.jsonl."""
    out: dict[str, float] = {}
    for stage in STAGES:
        mine = {r.split("/", 1)[1]: n for r, n in counts.items() if r.startswith(f"{stage}/")}
        if stage in OPTIONAL_STAGES and not any(mine.values()):
            continue
        out[f"{prefix}/{stage}_failed"] = float(sum(mine.values()))
        out |= {f"{prefix}/{stage}_failed/{name}": float(n) for name, n in mine.items() if n}
    return out


def merge_counts(*counts: Mapping[str, int]) -> dict[str, int]:
    """Counts by reason summed (a step's, and those of the batches before it that trained
    nothing)."""
    total: collections.Counter[str] = collections.Counter()
    for c in counts:
        total.update(c)
    return dict(sorted(total.items()))


def counts_from_metrics(metrics: Mapping[str, object], prefix: str) -> dict[str, int]:
    """The counts by reason back from a metrics line (`failure_metrics`' inverse)."""
    out: dict[str, int] = {}
    for stage in STAGES:
        head = f"{prefix}/{stage}_failed/"
        for key, value in metrics.items():
            if key.startswith(head) and isinstance(value, int | float) and value:
                out[f"{stage}/{key[len(head) :]}"] = int(value)
    return dict(sorted(out.items()))


def describe_counts(counts: Mapping[str, int]) -> str:
    """'reward non_finite 2, reward raised 1' (most first), for one line of the console."""
    ranked = sorted(((n, r) for r, n in counts.items() if n), key=lambda p: (-p[0], p[1]))
    return ", ".join(f"{reason.replace('/', ' ')} {n}" for n, reason in ranked)


def failed_in_group(group: Sequence[Sample]) -> list[Sample]:
    """The FAILED samples of a group, each with its place in the group kept in its metadata
    (`place`: a group's samples share their group and index)."""
    return [
        dataclasses.replace(s, metadata={**s.metadata, "place": place})
        for place, s in enumerate(group)
        if s.status is Status.FAILED
    ]


def full_error(sample: Sample) -> str:
    """'group 3 sample 1, index 12: reward_fn pkg.mod.fn raised ValueError: no label' (the
    sample's group, its place in it when known, its prompt's index, then the error)."""
    error = str(sample.metadata.get("error", "")) or "no error recorded"
    place = sample.metadata.get("place")
    where = f"group {sample.group_index}" + (f" sample {place}" if place is not None else "")
    return f"{where}, index {sample.index}: {error}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FailureLines:
    """What to print about some failures, and how many errors per reason are shown by then."""

    lines: tuple[str, ...]
    shown: Mapping[str, int]


def failure_lines(
    head: str,
    counts: Mapping[str, int],
    failed: Iterable[Sample],
    shown: Mapping[str, int],
    max_full: int = MAX_FULL_ERRORS,
) -> FailureLines:
    """'{head}: 4 sample(s) failed (reward non_finite 2, ...)', then, indented, in full each
    error of a reason shown fewer than `max_full` times so far (`shown`, given back updated).
    No failure: no line."""
    assert max_full >= 0, f"{max_full=} must be >= 0"
    total = sum(counts.values())
    if not total:
        return FailureLines(lines=(), shown=dict(shown))
    lines = [f"{head}: {total} sample(s) failed ({describe_counts(counts)})"]
    seen = collections.Counter(shown)
    for sample in failed:
        reason = failure_reason(sample)
        if seen[reason] < max_full:
            seen[reason] += 1
            lines.append(f"  {reason.split('/')[0]} failed at {full_error(sample)}")
    return FailureLines(lines=tuple(lines), shown=dict(seen))
