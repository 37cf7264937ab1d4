"""Pure decisions of the rollout manager: how many groups to submit, when a batch is done,
and whether a sample is too stale to train on.

The manager owns no policy of its own: it feeds its counters to these functions and does what
they say, so every decision is tested without a server.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Sequence

from rollouts.config import RolloutMode
from rollouts.types import Sample


class Outcome(enum.Enum):
    """Where a batch stands after a group finished."""

    CONTINUE = "continue"  # wait for in-flight groups (or submit more)
    DONE = "done"  # enough groups kept: abort the rest
    SHORT = "short"  # nothing in flight, no round left (or no data): a short batch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RoundState:
    """Counters of one batch: groups kept so far, in flight, and submitted in all.

    A round is a wave of `wave` groups (`ceil(target * over_sampling_factor)`): the bound
    `max_over_sampling_rounds` limits the groups submitted to `max_rounds * wave`, however they
    were split into top-ups, so it bounds the waste and not the number of top-ups.
    `passed` of `judged`: the groups the filters passed (kept or surplus) of those they judged,
    in this batch and, as `prior_passed` of `prior_judged`, in the last one: the keep rate that
    sizes top-ups (`groups_to_submit`).
    """

    target: int
    wave: int
    kept: int = 0
    in_flight: int = 0
    submitted: int = 0
    exhausted: bool = False  # the data source gave fewer groups than asked
    passed: int = 0
    judged: int = 0
    prior_passed: int = 0
    prior_judged: int = 0

    def __post_init__(self) -> None:
        assert self.target >= 1, f"{self.target=} must be >= 1"
        assert self.wave >= self.target, f"{self.wave=} must be >= {self.target=}"
        assert self.kept >= 0, f"{self.kept=} must be >= 0"
        assert self.in_flight >= 0, f"{self.in_flight=} must be >= 0"
        assert 0 <= self.passed <= self.judged, f"{self.passed=} {self.judged=}"
        assert 0 <= self.prior_passed <= self.prior_judged, f"{self.prior_passed=}"

    @property
    def rounds(self) -> int:
        """Waves' worth of groups submitted so far (a partial wave counts as one)."""
        return math.ceil(self.submitted / self.wave)


def new_round_state(
    target: int, over_sampling_factor: float, last: tuple[int, int] = (0, 0)
) -> RoundState:
    """The counters of a new batch of `target` groups; `last`: (passed, judged) by the filters
    in the batch before (its keep rate is this batch's first estimate)."""
    assert over_sampling_factor >= 1.0, f"{over_sampling_factor=} must be >= 1"
    wave = math.ceil(target * over_sampling_factor)
    return RoundState(target=target, wave=wave, prior_passed=last[0], prior_judged=last[1])


def in_flight_credit(state: RoundState, over_sampling_factor: float) -> float:
    """What a group in flight is expected to add to the batch, in (0, 1]: 1 while the filters
    pass at least 1 group in `over_sampling_factor` (the factor covers the rest), else the
    keep rate times the factor. The keep rate counts this batch's verdicts and the last
    batch's, plus a wave that went as the factor assumes (`target` passed of `target *
    factor`): a few early verdicts move it little, and with none the credit is exactly 1 (the
    fixed factor's rule). Factor 1 asks for no over-sampling: a dropped group is replaced one
    for one, so the groups submitted never depend on the order groups finish in (same-seed
    runs stay equal)."""
    f, target = over_sampling_factor, state.target
    if f <= 1.0:
        return 1.0
    passed = state.passed + state.prior_passed + target
    judged = state.judged + state.prior_judged + target * f
    return min(1.0, passed * f / judged)


def groups_to_submit(state: RoundState, over_sampling_factor: float, max_rounds: int) -> int:
    """Groups to submit now, or 0.

    More are submitted only when the groups in flight, each worth its expected share of a kept
    group (`in_flight_credit`: 1 while the filters keep enough), would leave the batch short:
    the missing groups times the over-sampling factor over that share, minus what is in
    flight, within what is left of the budget of `max_rounds` waves. When the filters drop
    most groups (late in GRPO training, most groups all right), top-ups grow to what the keep
    rate needs, so the engines get full batches, not a few groups at a time.
    """
    assert over_sampling_factor >= 1.0, f"{over_sampling_factor=} must be >= 1"
    missing = state.target - state.kept
    budget = max_rounds * state.wave - state.submitted
    credit = in_flight_credit(state, over_sampling_factor)
    if missing <= state.in_flight * credit or budget <= 0 or state.exhausted:
        return 0
    wanted = math.ceil(missing * over_sampling_factor / credit)
    return min(max(wanted - state.in_flight, 1), budget)


def batch_outcome(state: RoundState, max_rounds: int) -> Outcome:
    """DONE when enough groups are kept; SHORT when nothing more can come; else CONTINUE."""
    if state.kept >= state.target:
        return Outcome.DONE
    if state.in_flight > 0:
        return Outcome.CONTINUE
    if state.submitted >= max_rounds * state.wave or state.exhausted:
        return Outcome.SHORT
    return Outcome.CONTINUE


def version_number(version: str) -> int:
    """A weight version as an int; the engines' initial "default" (or "") is version 0."""
    if version in ("", "default"):
        return 0
    try:
        return int(version)
    except ValueError as e:
        raise ValueError(
            f"weight version {version!r} is not an integer: staleness needs numbered versions "
            "(the weight sync sets str(step))"
        ) from e


def sample_staleness(weight_versions: Sequence[str], current_version: str) -> int:
    """Policy versions between the oldest part of a sample and the current policy."""
    assert weight_versions, "a generated sample has at least one weight version"
    oldest = min(version_number(v) for v in weight_versions)
    return version_number(current_version) - oldest


def is_fresh_enough(sample: Sample, current_version: str, max_staleness: int) -> bool:
    """True when every part of `sample` is at most `max_staleness` versions old."""
    assert max_staleness >= 0, f"{max_staleness=} must be >= 0"
    return sample_staleness(sample.weight_versions, current_version) <= max_staleness


def staleness_bound(max_staleness: int, mode: RolloutMode, sync_every: int) -> int:
    """The staleness bound of a run: `rollout.max_staleness`, or with -1 (automatic) the most a
    freshly generated sample can lag: `sync_every - 1`, plus 1 in async mode (the producer runs
    one batch ahead). Only resumed partial work older than that is ever dropped."""
    assert mode in typing.get_args(RolloutMode), f"{mode=}"
    assert sync_every >= 1, f"{sync_every=} must be >= 1"
    if max_staleness >= 0:
        return max_staleness
    return sync_every - 1 + (mode == "async")


def is_stale_partial(group: Sequence[Sample], current_version: str, max_staleness: int) -> bool:
    """A partial group (resumed or saved surplus) with a part older than the bound: resuming it
    would spend generation on samples the trainer then drops."""
    return any(
        s.weight_versions and not is_fresh_enough(s, current_version, max_staleness) for s in group
    )


def split_stale_groups(
    groups: Sequence[Sequence[Sample]], current_version: str, max_staleness: int
) -> tuple[list[tuple[Sample, ...]], list[tuple[Sample, ...]]]:
    """(fresh groups, stale groups): a group is stale when any of its samples is."""
    fresh: list[tuple[Sample, ...]] = []
    stale: list[tuple[Sample, ...]] = []
    for group in groups:
        ok = all(is_fresh_enough(s, current_version, max_staleness) for s in group)
        (fresh if ok else stale).append(tuple(group))
    return fresh, stale
