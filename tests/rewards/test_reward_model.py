"""Reward-model scoring with a tiny local sequence-classification model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rollouts.rewards.reward_model import RewardModel, reward_model_fn
from rollouts.rewards.scoring import score_sample
from rollouts.types import Sample, Status


@pytest.fixture(scope="module")
def rm(tiny_model_dir: Path) -> RewardModel:
    # the tiny causal LM's weights with a fresh (seeded by the kit's init) one-label head
    return RewardModel.load(str(tiny_model_dir), max_length=64)


def test_batched_scores_equal_single_scores(rm: RewardModel):
    texts = ["1+1=2", "a much longer text than the first", "x"]
    batched = rm.score_texts(texts, batch_size=3)
    single = [rm.score_texts([t])[0] for t in texts]
    assert all(math.isfinite(s) for s in batched)
    assert batched == pytest.approx(single, abs=1e-4)  # padding does not change a score
    assert len(set(batched)) == 3


async def test_reward_model_as_reward_fn(rm: RewardModel):
    sample = Sample(
        index=0,
        group_index=0,
        prompt="2+2=",
        tokens=(1, 2),
        loss_mask=(0, 1),
        response_length=1,
        status=Status.COMPLETED,
        metadata={"response_text": "4"},
    )
    out = await score_sample(sample, reward_model_fn(rm), timeout_s=30)
    assert out.reward == pytest.approx(rm.score_texts(["2+2=4"])[0], abs=1e-5)
