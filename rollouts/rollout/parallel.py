"""Keep `num_parallel` trajectories in flight: start a new one as soon as one finishes.

`maintain_parallel_count` runs a pool of `num_parallel` workers; each takes the next sample from
`make_sample()`, generates it, and immediately takes another, until `total` trajectories have
been started or `make_sample()` returns None. Between a finish and the next start there is no
checkpoint, so while work remains exactly `num_parallel` trajectories are in flight: long
multi-turn episodes never leave the engine idle the way fixed batches do.

Bounded: `total` trajectories at most; each one under `sample_timeout_s` (a timeout or a raise
marks it FAILED, counted, error in metadata); the whole run under `deadline_s` (trajectories
still in flight then are dropped and counted as cancelled). Samples come back in the order they
finished; `ParallelRunStats` holds counts and response-length statistics.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from rollouts.plugins import call_maybe_async
from rollouts.rollout.batch import compute_response_lengths, length_histogram
from rollouts.rollout.generate import fail_sample
from rollouts.types import Sample, Status


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelRunStats:
    """What a `maintain_parallel_count` run did, and the lengths of what it produced."""

    num_started: int
    num_finished: int  # samples returned (FAILED ones included)
    num_failed: int  # raised or timed out
    num_timed_out: int
    num_cancelled: int  # in flight when `deadline_s` passed: dropped
    max_in_flight: int
    statuses: Mapping[str, int]
    response_length_mean: float
    response_length_max: int
    response_length_hist: Mapping[str, list[int]]
    turns_mean: float  # assistant turns per trajectory (multi-turn samples), else 0
    elapsed_s: float


@dataclasses.dataclass(kw_only=True, slots=True)
class _Pool:
    """Mutable bookkeeping of one run (local to one call)."""

    total: int
    started: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    timed_out: int = 0
    exhausted: bool = False
    results: list[Sample] = dataclasses.field(default_factory=list)


def run_stats(
    samples: Sequence[Sample],
    *,
    started: int,
    timed_out: int,
    max_in_flight: int,
    elapsed_s: float,
) -> ParallelRunStats:
    """Statistics of a run: counts by status; lengths of the samples that did not fail."""
    assert started >= len(samples), f"{started=} < {len(samples)=}"
    ok = [s for s in samples if s.status is not Status.FAILED]
    lengths = compute_response_lengths(ok)
    turns = [int(s.metadata["turns"]) for s in ok if "turns" in s.metadata]
    return ParallelRunStats(
        num_started=started,
        num_finished=len(samples),
        num_failed=len(samples) - len(ok),
        num_timed_out=timed_out,
        num_cancelled=started - len(samples),
        max_in_flight=max_in_flight,
        statuses=dict(collections.Counter(s.status.value for s in samples)),
        response_length_mean=sum(lengths) / len(lengths) if lengths else 0.0,
        response_length_max=max(lengths, default=0),
        response_length_hist=length_histogram(lengths),
        turns_mean=sum(turns) / len(turns) if turns else 0.0,
        elapsed_s=elapsed_s,
    )


async def _generate_one(
    sample: Sample, generate: Callable[[Sample], Any], timeout_s: float, pool: _Pool
) -> Sample:
    """One trajectory; a raise, a timeout or a non-Sample result gives a FAILED sample."""
    try:
        with trio.fail_after(timeout_s):
            out = await call_maybe_async(generate, sample)
    except trio.TooSlowError:
        pool.timed_out += 1
        return fail_sample(sample, f"generate timed out after {timeout_s} s")
    except Exception as e:  # a user function: its error is that sample's error
        return fail_sample(sample, f"generate raised {type(e).__name__}: {e}")
    if not isinstance(out, Sample) or out.status is Status.PENDING:
        status = getattr(out, "status", None)
        return fail_sample(sample, f"generate returned {type(out).__name__} ({status=})")
    return out


async def _worker(
    pool: _Pool,
    make_sample: Callable[[], Sample | None],
    generate: Callable[[Sample], Any],
    timeout_s: float,
) -> None:
    """Take the next sample and generate it, again and again, with no pause in between."""
    while pool.started < pool.total and not pool.exhausted:
        sample = make_sample()
        if sample is None:
            pool.exhausted = True
            return
        pool.started += 1
        pool.in_flight += 1
        pool.max_in_flight = max(pool.max_in_flight, pool.in_flight)
        try:
            out = await _generate_one(sample, generate, timeout_s, pool)
        finally:
            pool.in_flight -= 1
        pool.results.append(out)


async def maintain_parallel_count(
    make_sample: Callable[[], Sample | None],
    generate: Callable[[Sample], Any],
    num_parallel: int,
    total: int,
    *,
    sample_timeout_s: float = 300.0,
    deadline_s: float = math.inf,
) -> tuple[list[Sample], ParallelRunStats]:
    """Generate up to `total` trajectories keeping `num_parallel` in flight (module docstring).

    `make_sample()` gives the next PENDING sample (None: no more); `generate(sample)` (async,
    or sync: run in a worker thread) returns it finished.
    """
    assert num_parallel >= 1, f"{num_parallel=} must be >= 1"
    assert total >= 0, f"{total=} must be >= 0"
    assert sample_timeout_s > 0, f"{sample_timeout_s=} must be > 0"
    assert deadline_s > 0, f"{deadline_s=} must be > 0"
    pool = _Pool(total=total)
    t0 = time.perf_counter()
    with trio.move_on_after(deadline_s):
        async with trio.open_nursery() as nursery:
            for _ in range(min(num_parallel, total)):
                nursery.start_soon(_worker, pool, make_sample, generate, sample_timeout_s)
    assert pool.in_flight == 0, f"{pool.in_flight=} after the run"
    assert pool.max_in_flight <= num_parallel, f"{pool.max_in_flight=} > {num_parallel=}"
    stats = run_stats(
        pool.results,
        started=pool.started,
        timed_out=pool.timed_out,
        max_in_flight=pool.max_in_flight,
        elapsed_s=time.perf_counter() - t0,
    )
    return pool.results, stats
