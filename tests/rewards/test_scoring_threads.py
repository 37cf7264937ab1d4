"""Hung sync reward functions are abandoned at their timeout without starving trio's threads."""

from __future__ import annotations

import threading

import trio

from rollouts.rewards.scoring import score_group
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
