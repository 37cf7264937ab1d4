"""maintain_parallel_count without a server: refills, bounds, failures, timeouts, deadline.

Trajectory "durations" are virtual (autojump_clock): a generate fn that sleeps `index` seconds.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import trio

from rollouts.rollout.parallel import maintain_parallel_count
from rollouts.types import Sample, Status


def source(limit: int | None = None):
    counter = itertools.count()

    def make_sample() -> Sample | None:
        i = next(counter)
        return (
            None if limit is not None and i >= limit else Sample(index=i, group_index=i, prompt="p")
        )

    return make_sample


def finished(sample: Sample, length: int) -> Sample:
    return dataclasses.replace(
        sample,
        tokens=(0,) * (length + 1),
        loss_mask=(0,) + (1,) * length,
        response_length=length,
        status=Status.COMPLETED,
        metadata={"turns": 1 + length % 2},
    )


async def test_refill_keeps_the_count_and_stops_at_total(autojump_clock) -> None:
    in_flight = 0
    at_start: list[int] = []
    starts: list[tuple[float, int]] = []

    async def generate(sample: Sample) -> Sample:
        nonlocal in_flight
        in_flight += 1
        at_start.append(in_flight)
        starts.append((trio.current_time(), sample.index))
        try:
            await trio.sleep(1 + sample.index % 3)  # 1, 2, 3, 1, 2, 3, ... seconds
        finally:
            in_flight -= 1
        return finished(sample, length=1 + sample.index)

    samples, stats = await maintain_parallel_count(source(), generate, num_parallel=3, total=10)
    assert sorted(s.index for s in samples) == list(range(10))
    assert at_start == [1, 2, 3] + [3] * 7  # a finish is refilled at once, never above 3
    t0 = starts[0][0]
    # sample 0 ends at t=1 and sample 3 starts then, not when the slowest of the first 3 ends
    assert dict((i, t - t0) for t, i in starts)[3] == 1.0
    assert (stats.num_started, stats.num_finished, stats.num_failed) == (10, 10, 0)
    assert (stats.num_cancelled, stats.max_in_flight) == (0, 3)
    assert stats.response_length_mean == pytest.approx(5.5)
    assert stats.response_length_max == 10
    assert sum(stats.response_length_hist["counts"]) == 10
    assert stats.turns_mean == pytest.approx(1.5)
    assert stats.statuses == {"completed": 10}


async def test_source_running_dry_and_failures_are_counted(autojump_clock) -> None:
    async def generate(sample: Sample) -> Sample:
        await trio.sleep(1)
        if sample.index == 1:
            raise RuntimeError("boom")
        if sample.index == 2:
            return sample  # still PENDING: not a finished sample
        if sample.index == 3:
            await trio.sleep_forever()
        return finished(sample, length=2)

    samples, stats = await maintain_parallel_count(
        source(limit=5), generate, num_parallel=2, total=100, sample_timeout_s=10.0
    )
    by_index = {s.index: s for s in samples}
    assert sorted(by_index) == [0, 1, 2, 3, 4]
    assert "generate raised RuntimeError: boom" in by_index[1].metadata["error"]
    assert "status=<Status.PENDING" in by_index[2].metadata["error"]
    assert "timed out after 10.0 s" in by_index[3].metadata["error"]
    assert (stats.num_started, stats.num_failed, stats.num_timed_out) == (5, 3, 1)
    assert stats.response_length_mean == 2.0  # failed samples are not in the lengths


async def test_deadline_drops_what_is_in_flight(autojump_clock) -> None:
    async def generate(sample: Sample) -> Sample:
        await trio.sleep(10 * (sample.index + 1))
        return finished(sample, length=1)

    samples, stats = await maintain_parallel_count(
        source(), generate, num_parallel=2, total=10, deadline_s=25.0
    )
    # 0 ends at 10, 1 at 20, 2 (started at 10) would end at 40, 3 (started at 20) at 60
    assert [s.index for s in samples] == [0, 1]
    assert (stats.num_started, stats.num_finished, stats.num_cancelled) == (4, 2, 2)


async def test_zero_total_and_bad_arguments() -> None:
    async def generate(sample: Sample) -> Sample:
        raise AssertionError("never called")

    samples, stats = await maintain_parallel_count(source(), generate, num_parallel=4, total=0)
    assert samples == []
    assert stats.num_started == 0
    with pytest.raises(AssertionError, match="num_parallel"):
        await maintain_parallel_count(source(), generate, num_parallel=0, total=1)
