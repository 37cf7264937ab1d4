"""A real run whose reward fails for some samples says what failed (issue 45, parts 3 and 4).

With a quarter of the rewards NaN, held-out accuracy counted them as wrong answers (0.165 where
the scored samples' accuracy was 0.228), and training said only a count, through a raw Python
ShortBatchWarning with a stray source line; the failed samples were missing from rollouts.jsonl.

train.py's `main` in this process (one RL step), the real built-in engine in its own process.
The pure parts are tested in tests/test_failures.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rollouts.driver.cli import main
from rollouts.types import Sample
from tests.training.test_train_e2e import _config

PROMPTS = 8


def flaky(sample: Sample) -> float:
    """By the prompt's index % 4: NaN, raises, a correct 1.0, a wrong 0.0."""
    kind = sample.index % 4
    if kind == 1:
        raise ValueError(f"verifier crashed on prompt {sample.index}")
    return (math.nan, 0.0, 1.0, 0.0)[kind]


def _data(path: Path) -> str:
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_run_with_failing_rewards_says_what_failed(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {"prepare": "", "sft_path": "", "eval_size": PROMPTS}
    data |= {
        "train_path": _data(tmp_path / "train.jsonl"),
        "eval_path": _data(tmp_path / "e.jsonl"),
    }
    config = _config(
        tmp_path,
        model={"path": str(tiny_model_dir)},
        model__tiny={"enabled": False},
        data=data,
        training={"rl_steps": 1},
        # 8 groups, no top-ups: the step is one epoch of the 8 prompts
        rollout={"reward_fn": f"{__name__}.flaky", "batch_size": 8, "max_over_sampling_rounds": 1},
        checkpoint={"every": 0},
        logging={"progress_bar": False},
    )
    code = main(["--mode", "rl", "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]

    # held-out: 2 NaN, 2 raised, 2 right, 2 wrong: accuracy 0.5 over the 4 scored (not 2 / 8)
    for row in (rows[0], rows[-1]):
        assert row["eval/accuracy"] == 0.5, row
        assert (row["eval/scored"], row["eval/failed"]) == (4.0, 4.0), row
        assert row["eval/reward_failed/non_finite"] == 2.0, row
        assert row["eval/reward_failed/raised"] == 2.0, row
    before = "held-out accuracy before RL: 0.500 (over the 4 scored samples; 4 failed: "
    assert before + "reward non_finite 2, reward raised 2)" in out, out

    # training: the step counts its failed rewards by reason, never as a reward of 0: 2 prompts
    # gave NaN and 2 raised, 2 samples each; the 4 groups left were trained
    step = rows[1]
    assert step["rollout/reward_failed"] == 8.0, step
    assert step["rollout/reward_failed/non_finite"] == 4.0, step
    assert step["rollout/reward_failed/raised"] == 4.0, step
    assert (step["rollout/groups_kept"], step["reward/mean"]) == (4.0, 0.5), step

    # the console: one line per step, the first errors in full, no Python warning
    line = "[train] step 1 rollouts: 8 sample(s) failed (reward non_finite 4, reward raised 4); "
    assert line + "short batch: only 4/8 groups kept" in out, out
    raised = rf"reward_fn {__name__}.flaky raised ValueError: verifier crashed on prompt \d+"
    where = r"\[train\]   reward failed at group \d+ sample \d, index \d+: "
    assert re.search(where + raised, out), out
    assert re.search(where + rf"reward_fn {__name__}.flaky returned a non-finite reward nan", out)
    assert "Warning" not in out + err, err[-3000:]

    # rollouts.jsonl: the failed samples, each with its error
    samples = [json.loads(r) for r in (run / "rollouts.jsonl").read_text().splitlines()]
    failed = [r for r in samples if r["status"] == "failed"]
    assert failed and all(r["reward"] is None for r in failed), failed
    assert {r["failure"] for r in failed} <= {"reward/non_finite", "reward/raised"}, failed
    assert all(f"reward_fn {__name__}.flaky" in r["error"] for r in failed), failed
    assert len(failed) == 8, failed

    # the summary: how many failed and why
    summary = out[out.index("---- summary ----") :]
    assert (
        "failed:     8 rollout sample(s) in 1 step(s) (reward non_finite 4, reward raised 4)"
        in (summary)
    ), summary
    assert "failed:     held-out at step 1 (over the 4 scored samples; 4 failed: " in summary
