"""The end-of-run summary and the quiet console."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollouts.driver.summary import (
    finish_run,
    format_duration,
    phase_line,
    summarize_phase,
    summary_lines,
)


def test_summarize_phase_reads_before_after_and_best() -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.2},
        {"step": 1, "reward/mean": 0.1},
        {"step": 5, "eval/accuracy": 0.5},
        {"step": 10, "eval/accuracy": 0.4},
    ]
    p = summarize_phase("RL", rows, "eval/accuracy")
    assert p is not None
    assert (p.steps, p.before, p.after, p.best) == (10, 0.2, 0.4, (5, 0.5))
    line = phase_line(p, "held-out accuracy", 125.0)
    assert line == "RL: 10 steps in 2m05s; held-out accuracy 0.200 -> 0.400 (best 0.500 at step 5)"
    assert summarize_phase("RL", [], "eval/accuracy") is None
    bare = summarize_phase("RL", [{"step": 3, "reward/mean": 1.0}], "eval/accuracy")
    assert bare is not None and phase_line(bare, "acc", None) == "RL: 3 steps"


def test_a_loss_is_best_when_lowest_and_starts_at_its_first_evaluation() -> None:
    # the SFT line once read "held-out loss n/a -> 0.039 (best 1.347 at step 20)"
    rows = [
        {"step": 1, "sft/loss": 5.0},
        {"step": 20, "sft/eval_loss": 1.347},
        {"step": 40, "sft/eval_loss": 0.03},
        {"step": 60, "sft/eval_loss": 0.039},
    ]
    p = summarize_phase("SFT", rows, "sft/eval_loss", higher_is_better=False)
    assert p is not None
    assert (p.before, p.after, p.best) == (1.347, 0.039, (40, 0.03))
    line = phase_line(p, "held-out loss", None)
    assert line == "SFT: 60 steps; held-out loss 1.347 -> 0.039 (best 0.030 at step 40)"


def test_format_duration() -> None:
    assert [format_duration(s) for s in (8.4, 61, 3720)] == ["8s", "1m01s", "1h02m"]


def test_finish_run_writes_plots_and_says_where_to_look(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "time/train_s": 1.0} for s in (1, 2)]
    rows[-1]["eval/accuracy"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text("{}")
    ckpt = tmp_path / "checkpoints" / "rl" / "step_000002"
    lines = finish_run(tmp_path, 75.0, ckpt)
    out = capsys.readouterr().out
    assert "[train] ---- summary ----" in out
    assert lines[0] == "RL: 2 steps; held-out accuracy 0.250 -> 0.500"
    assert lines[1] == "wall time:  1m15s"
    assert lines[2] == f"run dir:    {tmp_path}  (config.json, metrics.jsonl)"
    assert lines[3].startswith(f"checkpoint: {ckpt / 'model'}")
    assert lines[4].startswith(f"plots:      {tmp_path / 'plots'}  (")
    assert (tmp_path / "plots" / "accuracy.png").is_file()
    best = {"name": "step_000001", "metric": "eval/accuracy", "value": 0.75}
    lines = summary_lines(tmp_path, [], 1.0, ckpt, [], "", best)
    assert (
        lines[-1] == f"best:       {ckpt.parent / 'step_000001' / 'model'}  (eval/accuracy 0.750)"
    )


def test_finish_run_without_rl_metrics_says_why_no_plots(tmp_path: Path) -> None:
    (tmp_path / "sft_metrics.jsonl").write_text(json.dumps({"step": 4, "sft/loss": 1.0}) + "\n")
    lines = finish_run(tmp_path, 3.0, None)
    assert lines[0] == "SFT: 4 steps"
    assert lines[-1] == "plots:      none (no RL metrics)"


def test_plots_off_writes_none_and_says_how_to_get_them(tmp_path: Path) -> None:
    rows = [{"step": 1, "reward/mean": 0.5, "eval/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = finish_run(tmp_path, 3.0, None, plots=False)
    assert lines[-1] == (
        f"plots:      none (logging.plots = false; `rollouts plot {tmp_path}` writes them)"
    )
    assert not (tmp_path / "plots").exists()
