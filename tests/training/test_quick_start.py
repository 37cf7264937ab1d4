from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollouts.driver.quick_start import quick_start_training
from rollouts.types import Sample

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py


def reward_len_mod_2(sample: Sample) -> float:
    return float(sample.response_length % 2)


SMALL = {
    "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "sampling": {"max_new_tokens": 6}},
    "logging": {"console": False},
}


def test_quick_start_runs_rl_steps_with_a_plain_function(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    prompts = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(10, 20)]
    for _ in range(2):  # the same output_dir twice: the second call replaces the first run
        result = quick_start_training(
            tiny_model_dir,
            prompts,
            reward_len_mod_2,
            num_iterations=2,
            output_dir=tmp_path / "run",
            overrides=SMALL,
        )
        assert result.metrics["policy/version"] == 2.0
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in rows] == [1, 2]
    assert result.run_dir == tmp_path / "run"
    assert result.checkpoint == tmp_path / "run" / "checkpoints" / "rl" / "step_000002"
    assert result.model_dir is not None
    assert (result.model_dir / "config.json").is_file()
    assert f"trained model {result.model_dir}" in capsys.readouterr().out


def test_quick_start_without_output_dir_says_where_the_model_is(tiny_model_dir: Path) -> None:
    result = quick_start_training(
        tiny_model_dir, ["1+1=", "2+2="], reward_len_mod_2, num_iterations=1, overrides=SMALL
    )
    try:
        assert result.model_dir is not None
        assert (result.model_dir / "model.safetensors").is_file()
        assert result.model_dir.is_relative_to(result.run_dir)
    finally:
        shutil.rmtree(result.run_dir)


def test_quick_start_rejects_bad_prompts(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a string or a dict"):
        quick_start_training(tiny_model_dir, ["ok", 3], reward_len_mod_2, num_iterations=1)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def always_raises(sample: Sample) -> float:
    raise ValueError("verifier crashed")


def test_a_reward_fn_that_always_raises_stops_the_run(tiny_model_dir: Path, tmp_path: Path):
    """Every sample FAILED (never a reward of 0): after 3 batches that trained nothing (not
    steps: nothing is logged as one) the run stops, loudly."""
    with pytest.raises(BaseException) as info:
        quick_start_training(
            tiny_model_dir,
            ["1+1=", "2+2="],
            always_raises,
            num_iterations=5,
            output_dir=tmp_path / "run",
            overrides={
                "rollout": {
                    "batch_size": 1,
                    "n_samples_per_prompt": 2,
                    "sampling": {"max_new_tokens": 4},
                },
                "logging": {"console": False},
            },
        )
    messages = [str(e) for e in _leaves(info.value)]
    assert any("RL made no update in 3 batches in a row" in m for m in messages), messages
    assert any("verifier crashed" in m for m in messages), messages
    assert any("quick_start.always_raises raised ValueError" in m for m in messages), messages
    # every sample (2 per group) of every group the batch saw (8: 4 over-sampling rounds), not 0
    said = "no trainable sample (16 sample(s) failed, groups dropped by the filters: {'failed': 8})"
    assert any(said in m for m in messages), messages
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no update: no step logged
