"""Bad reward functions against the real engine server: training and evaluation score alike.

A reward that hangs is cut at `reward_timeout_s`; a group's samples are scored concurrently; a
reward that raises, returns None, a string, NaN or an infinity marks that sample FAILED with an
error that names the function, in the rollout manager and in the held-out evaluation.
"""

from __future__ import annotations

import threading

import pytest

from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import PromptItem, Sample, Status
from tests.rollout import manager_cases as cases


async def test_reward_timeout_is_enforced(engine, tok) -> None:
    """A sync reward that would sleep 30 s with a 1 s bound: FAILED, named, not waited for."""
    release = threading.Event()

    def sleeps(sample: Sample) -> float:
        release.wait(30)
        return 1.0

    config = cases.make_config(
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        max_over_sampling_rounds=1,
        reward_timeout_s=1.0,
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    try:
        batch = await manager.generate_batch(sleeps)
    finally:
        release.set()
    assert batch.metadata["failed_samples"] == 2, batch.metadata
    assert batch.metadata["failures"] == {"reward/timed_out": 2}
    assert any("sleeps timed out after 1.0 s" in e for e in batch.metadata["errors"])


async def test_a_groups_samples_are_scored_concurrently(engine, tok) -> None:
    """Each sample's reward waits for all 4 of its group: only concurrent scoring passes."""
    barrier = threading.Barrier(4, timeout=20)

    def together(sample: Sample) -> float:
        barrier.wait()
        return float(sample.index % 2)

    config = cases.make_config(batch_size=1, n_samples_per_prompt=4, over_sampling_factor=1.0)
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(together)
    assert batch.metadata["errors"] == []
    assert [s.status for s in batch.samples] != [Status.FAILED] * 4
    assert all(s.reward is not None for s in batch.samples)


async def test_failed_samples_are_counted_when_every_sample_failed(engine, tok) -> None:
    def raises(sample: Sample) -> float:
        raise ValueError("verifier crashed")

    config = cases.make_config(
        batch_size=2, n_samples_per_prompt=2, over_sampling_factor=1.0, max_over_sampling_rounds=1
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(raises)
    assert batch.metadata["failed_samples"] == 4, batch.metadata
    assert batch.metadata["short_batch"] is True
    # every sample FAILED, never a reward of 0: counted by reason, carried out to be reported
    assert batch.metadata["failures"] == {"reward/raised": 4}
    assert [s.status for s in batch.failed] == [Status.FAILED] * 4
    assert all(s.reward is None for s in batch.failed)
    assert "raised ValueError: verifier crashed" in batch.failed[0].metadata["error"]


BAD = {
    0: ("nan", "non-finite"),
    1: ("inf", "non-finite"),
    2: ("1.0", "expected a float"),
    3: (None, "expected a float"),
    4: ("raise", "raised KeyError"),
}


def picky_reward(sample: Sample) -> object:
    """Item 0: NaN, 1: +inf, 2: the string "1.0", 3: None, 4: raises; others: 1.0."""
    kind = BAD.get(sample.index, ("ok", ""))[0]
    if kind == "raise":
        raise KeyError("no label")
    return {"nan": float("nan"), "inf": float("inf"), "ok": 1.0}.get(kind, kind)  # type: ignore[arg-type]


async def test_evaluation_scores_bad_rewards_like_training(engine, tok) -> None:
    items = [PromptItem(index=i, prompt=f"q{i}:") for i in range(7)]
    spec = EvalSpec(max_new_tokens=4, reward_timeout_s=5.0)
    result = await evaluate(engine, tok, items, picky_reward, spec)
    assert result.failed == 5
    assert result.scored == 2  # the "1.0" is not accepted
    assert result.accuracy == 1.0  # over the scored samples (items 5 and 6), not 2 / 7
    assert result.failures == {
        "reward/non_finite": 2,
        "reward/not_a_reward": 2,
        "reward/raised": 1,
    }
    by_index = {s.index: s for s in result.samples}
    for index, (_, expected) in BAD.items():
        s = by_index[index]
        assert s.status is Status.FAILED and s.reward is None
        error = s.metadata["error"]
        assert "picky_reward" in error and expected in error, error
    assert by_index[5].reward == 1.0


def returns_none(sample: Sample) -> None:
    return None


async def test_evaluation_where_every_reward_fails_names_the_function(engine, tok) -> None:
    items = [PromptItem(index=i, prompt=f"q{i}:") for i in range(2)]
    with pytest.raises(RuntimeError, match="every eval rollout failed.*returns_none returned None"):
        await evaluate(engine, tok, items, returns_none, EvalSpec(max_new_tokens=2))
