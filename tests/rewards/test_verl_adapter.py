"""verl_reward: verl-style compute_score functions as RewardFns."""

from __future__ import annotations

import pytest

from rollouts.plugins import PluginError
from rollouts.rewards.scoring import score_sample
from rollouts.rewards.verl_adapter import verl_reward
from rollouts.types import Sample, Status

CALLS: list[dict] = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style scorer: 1.0 if the last word is the answer; a dict for 'rich' sources."""
    CALLS.append({"data_source": data_source, "extra_info": extra_info})
    correct = solution_str.split()[-1] == str(ground_truth)
    if data_source == "rich":
        return {"score": 0.75 if correct else -0.25, "acc": correct, "pred": solution_str}
    return 1.0 if correct else 0.0


def no_extra_info(data_source, solution_str, ground_truth):
    return len(solution_str) == ground_truth  # a bool, as some verl scorers return


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0}


def sample(text: str | None, label="4", **metadata) -> Sample:
    if text is not None:
        metadata["response_text"] = text
    return Sample(
        index=3,
        group_index=0,
        prompt="2+2?",
        label=label,
        tokens=(1, 2),
        loss_mask=(0, 1),
        response_length=1,
        status=Status.COMPLETED,
        metadata=metadata,
    )


def test_float_and_dict_results():
    CALLS.clear()
    reward = verl_reward("tests.rewards.test_verl_adapter.compute_score")
    assert reward(sample("the answer is 4", data_source="gsm8k", split="train")) == 1.0
    assert CALLS[-1]["data_source"] == "gsm8k"
    assert CALLS[-1]["extra_info"] == {
        "response_text": "the answer is 4",
        "data_source": "gsm8k",
        "split": "train",
    }
    assert reward(sample("it is 5")) == 0.0
    assert CALLS[-1]["data_source"] == ""  # no data_source in metadata
    assert reward(sample("so 4", source="rich")) == 1.0  # default key: "rich" unseen, float
    by_key = verl_reward(compute_score, data_source_key="source")
    assert by_key(sample("so 4", source="rich")) == 0.75  # dict -> its "score"
    assert by_key(sample("so 3", source="rich")) == -0.25


def test_functions_without_extra_info_and_bools():
    reward = verl_reward(no_extra_info)
    assert reward(sample("abcd", label=4)) == 1.0
    assert reward(sample("abc", label=4)) == 0.0


def test_errors_are_clear():
    reward = verl_reward(compute_score)
    with pytest.raises(ValueError, match=r"metadata\['response_text'\]"):
        reward(sample(None))
    with pytest.raises(TypeError, match="expected a number or a dict"):
        verl_reward(lambda data_source, solution_str, ground_truth: "good")(sample("x"))
    with pytest.raises(ValueError, match="without a 'score' key"):
        verl_reward(lambda data_source, solution_str, ground_truth: {"acc": 1})(sample("x"))
    with pytest.raises(ValueError, match="non-finite"):
        verl_reward(lambda data_source, solution_str, ground_truth: float("nan"))(sample("x"))
    with pytest.raises(PluginError, match="no parameter"):
        verl_reward(lambda source, text, gold: 1.0)


async def test_async_scorer_and_scoring_pipeline():
    scored = await score_sample(sample("x"), verl_reward(async_score), timeout_s=5.0)
    assert scored.reward == 2.0
    # a verl function that fails marks the sample FAILED (never a 0 reward)
    failed = await score_sample(sample(None), verl_reward(compute_score), timeout_s=5.0)
    assert failed.status is Status.FAILED
    assert "response_text" in failed.metadata["error"]
