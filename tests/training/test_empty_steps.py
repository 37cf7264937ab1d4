"""A run whose every sample fails says so (issue 27 item 11): with every reward timing out and
rl_steps = 1 it used to exit 0 with a checkpoint and no reason on the console. Such batches are
not steps (item 1): each says why on the console, and 3 in a row stop the run.

train.py's `main` in this process, with the real built-in engine in its own process."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from rollouts.driver.cli import main
from rollouts.loop.empty_steps import empty_batch_reason
from rollouts.types import RolloutBatch, Sample, Status
from tests.training.test_train_e2e import _config


def done() -> Sample:
    return Sample(
        index=0,
        group_index=0,
        prompt="p",
        tokens=(1, 2),
        loss_mask=(0, 1),
        response_length=1,
        status=Status.COMPLETED,
        weight_versions=("0",),
    )


def too_slow(sample: object) -> float:
    """A reward function slower than rollout.reward_timeout_s = 0.2 s."""
    time.sleep(1.0)
    return 1.0


def test_empty_batch_reason_names_failures_drops_and_the_first_error() -> None:
    meta = {
        "failed_samples": 8,
        "drop_reasons": {"failed": 4, "zero_std": 0},
        "errors": ["reward_fn x timed out after 0.2 s", "another"],
    }
    reason = empty_batch_reason(RolloutBatch(groups=(), metadata=meta))
    assert reason == (
        "no trainable sample (8 sample(s) failed, groups dropped by the filters: {'failed': 4}); "
        "first error: reward_fn x timed out after 0.2 s"
    )
    assert empty_batch_reason(RolloutBatch(groups=())) == "no trainable sample (no group was kept)"
    stale = RolloutBatch(groups=((done(),),), metadata={})
    assert empty_batch_reason(stale) is None  # a group to train
    assert empty_batch_reason(stale, stale_groups=1) == (
        "no trainable sample (1 group(s) too stale to train (rollout.max_staleness))"
    )


def test_a_run_where_every_reward_times_out_says_why_and_fails(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a}+1=", "label": "x"}) + "\n" for a in "123"))
    config = _config(
        tmp_path,
        model={"path": str(tiny_model_dir)},
        model__tiny={"enabled": False},
        data={"prepare": "", "train_path": str(train), "sft_path": "", "eval_path": ""},
        training={"rl_steps": 1},
        rollout={
            "reward_fn": f"{__name__}.too_slow",
            "reward_timeout_s": 0.2,
            "max_over_sampling_rounds": 1,
        },
        logging={"progress_bar": False},
    )
    code = main(["--mode", "rl", "--config", str(config)])
    captured = capsys.readouterr()
    # every reward failed: no reward of 0; the step's one line says why, with no Python warning
    line = "[train] step 1 rollouts: 4 sample(s) failed (reward timed_out 4); short batch: only 0/2"
    assert line in captured.out, captured.out
    full = re.escape(f"reward_fn {__name__}.too_slow timed out after 0.2 s")
    for place in (0, 1):  # the first errors in full, each with its group, place and index
        where = rf"\[train\]   reward failed at group \d+ sample {place}, index \d+: "
        assert re.search(where + full, captured.out), captured.out
    assert "[train] batch 3 rollouts (step 1): 4 sample(s) failed" in captured.out
    assert "Warning" not in captured.out + captured.err
    rows = [json.loads(r) for r in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 4 and {r["status"] for r in rows} == {"failed"}, rows
    assert {r["failure"] for r in rows} == {"reward/timed_out"} and rows[0]["reward"] is None
    assert code == 1, captured.out[-2000:] + captured.err[-2000:]  # was: 0, and no word
    said = "[train] batch 1 trained nothing (not a step, 1/3 in a row): no trainable sample (4 "
    assert said + "sample(s) failed" in captured.out, captured.out
    assert f"first error: reward_fn {__name__}.too_slow timed out after 0.2 s" in captured.out
    assert "error: RL made no update in 3 batches in a row (after step 0)" in captured.err
    assert "rollout.reward_timeout_s" in captured.err
    assert not (tmp_path / "run" / "checkpoints" / "rl").exists()  # nothing trained to save
