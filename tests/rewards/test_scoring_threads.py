"""Hung sync reward functions are abandoned at their timeout without starving trio's threads."""

from __future__ import annotations

import dataclasses
import threading
import time

import trio

from rollouts.rewards.scoring import FAST_CALL_S, FAST_WINDOW, call_times, score_group
from rollouts.types import Sample, Status


def _done(i: int) -> Sample:
    return Sample(
        index=i, group_index=0, prompt="q", tokens=(1, 2), loss_mask=(0, 1), status=Status.COMPLETED
    )


async def test_hung_rewards_leave_the_default_threads_free() -> None:
    """45 verifiers stuck for good (more than trio's 40 default threads): each sample FAILS at
    its timeout, and a blocking call of the trainer still gets a worker thread at once."""
    release = threading.Event()

    def stuck(sample: Sample) -> float:
        release.wait(60)
        return 1.0

    try:
        with trio.fail_after(30):
            out = await score_group([_done(i) for i in range(45)], stuck, timeout_s=0.5)
        assert all(s.status is Status.FAILED for s in out)
        assert "timed out after 0.5 s" in str(out[0].metadata["error"])
        with trio.fail_after(10):  # a checkpoint's thread: not queued behind the hung verifiers
            assert await trio.to_thread.run_sync(lambda: 7) == 7
    finally:
        release.set()


def _reward(sample: Sample) -> object:
    """Exact rewards and every kind of bad one, by the sample's index."""
    kind = sample.index % 6
    if kind == 1:
        raise ValueError(f"no answer in sample {sample.index}")
    return {0: 1.0, 2: float("nan"), 3: None, 4: (0.5, 1), 5: False}.get(kind)


def _hops(monkeypatch) -> list[int]:
    """The worker-thread hops made from now on (their count)."""
    hops: list[int] = []
    real = trio.to_thread.run_sync

    async def counted(*args, **kwargs):
        hops.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    return hops


def _summary(samples: tuple[Sample, ...]) -> list[tuple]:
    return [(s.status, s.reward, s.metadata.get("failure")) for s in samples]


async def test_a_fast_reward_scores_a_group_in_one_hop_as_sample_by_sample(monkeypatch) -> None:
    """A sync function whose calls took microseconds: after FAST_WINDOW of them a group goes
    to one worker thread, its samples judged exactly as one hop each judges them (rewards,
    raises, NaN, None, tuples, bools), failed samples left as they were."""

    def reward(sample: Sample) -> object:  # a function of this test's own: fresh call times
        return _reward(sample)

    group = [_done(i) for i in range(16)]
    group[7] = dataclasses.replace(group[7], status=Status.FAILED)
    hops = _hops(monkeypatch)
    first = await score_group(group, reward, timeout_s=5)  # not yet known to be fast
    assert len(hops) == 15 and not call_times(reward).fast
    await score_group(group, reward, timeout_s=5)
    assert not call_times(reward).fast  # 30 calls: FAST_WINDOW is 32
    await score_group(group, reward, timeout_s=5)
    assert call_times(reward).fast
    hops.clear()
    again = await score_group(group, reward, timeout_s=5)
    assert len(hops) == 1
    assert _summary(again) == _summary(first)
    assert again[7] is group[7]
    assert [s.reward for s in again[:6]] == [1.0, None, None, None, (0.5, 1.0), 0.0]


async def test_a_call_that_hangs_in_the_hop_fails_its_sample_alone(monkeypatch) -> None:
    """The group's third call hangs: it fails at its timeout (having run at least that long),
    the calls before it keep their rewards, the ones after it are scored one hop each, and the
    function is slow again."""
    release, hang = threading.Event(), threading.Event()

    def reward(sample: Sample) -> float:
        if hang.is_set() and sample.index == 2:
            release.wait(30)
        return float(sample.index)

    group = [_done(i) for i in range(6)]
    for _ in range(FAST_WINDOW // len(group) + 1):
        await score_group(group, reward, timeout_s=5)
    assert call_times(reward).fast
    hang.set()
    hops = _hops(monkeypatch)
    try:
        start = trio.current_time()
        with trio.fail_after(30):
            out = await score_group(group, reward, timeout_s=0.5)
        assert trio.current_time() - start >= 0.5
    finally:
        release.set()
    assert len(hops) == 1 + 3  # the group's hop, then one each for the 3 after the hung call
    assert [s.reward for s in out] == [0.0, 1.0, None, 3.0, 4.0, 5.0]
    assert out[2].status is Status.FAILED
    assert "timed out after 0.5 s" in str(out[2].metadata["error"])
    assert not call_times(reward).fast


async def test_a_slow_reward_keeps_a_hop_a_sample(monkeypatch) -> None:
    def slow(sample: Sample) -> float:
        time.sleep(2 * FAST_CALL_S)
        return 1.0

    group = [_done(i) for i in range(FAST_WINDOW + 4)]
    await score_group(group, slow, timeout_s=5)
    hops = _hops(monkeypatch)
    out = await score_group(group, slow, timeout_s=5)
    assert len(hops) == len(group) and all(s.reward == 1.0 for s in out)
    assert not call_times(slow).fast


async def test_a_reward_of_a_millisecond_or_two_scores_a_group_in_one_hop(monkeypatch) -> None:
    """A verifier that decodes and parses a long answer takes a ms or two: not worth a thread
    hop a sample (at a 1 ms bound a sixth of the driver bench's groups went one hop a sample)."""

    def parse(sample: Sample) -> float:
        time.sleep(FAST_CALL_S / 4)
        return 1.0

    group = [_done(i) for i in range(16)]
    for _ in range(10):  # 32 calls in a row under FAST_CALL_S: within a few groups on a busy box
        await score_group(group, parse, timeout_s=5)
        if call_times(parse).fast:
            break
    assert call_times(parse).fast
    hops = _hops(monkeypatch)
    out = await score_group(group, parse, timeout_s=5)
    assert len(hops) == 1 and all(s.reward == 1.0 for s in out)
