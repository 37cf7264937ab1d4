from __future__ import annotations

import io
import json
from pathlib import Path

from rollouts.driver.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    format_eta,
    progress_line,
)
from rollouts.driver.plot import plot_run
from rollouts.types import Sample, Status


def test_jsonl_resume_cuts_back_to_the_checkpoint_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10})
    sink.close()
    resumed = JsonlSink(path, resume_step=3)  # killed after step 5, checkpoint at step 3
    for step in range(4, 7):
        resumed.log(step, {"reward/mean": step / 10})
    resumed.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_fresh_run_replaces_old_metrics(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 9}\n')
    JsonlSink(path).close()
    assert path.read_text() == ""


def test_non_finite_values_are_written_as_strings(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.log(1, {"train/loss": float("nan")})
    sink.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["train/loss"] == "nan"


def test_progress_line_and_eta() -> None:
    line = progress_line(5, 10, 65.0, {"reward/mean": 0.5, "eval/accuracy": 0.25})
    assert line.startswith("[##########..........] 5/10 eta 1m05s")
    assert "reward 0.500" in line
    assert "acc 0.250" in line
    assert format_eta(3725) == "1h02m"
    stream = io.StringIO()
    console = ConsoleSink(total_steps=4, prefix="rl ", stream=stream)
    console.log(1, {"train/loss": 1.0})
    assert stream.getvalue().startswith("rl [#####...............] 1/4")


def test_logger_writes_rollouts_and_plots(tmp_path: Path) -> None:
    logger = MetricsLogger([JsonlSink(tmp_path / "metrics.jsonl")], tmp_path / "rollouts.jsonl")
    sample = Sample(
        index=0,
        group_index=0,
        prompt="1+1",
        label="2",
        tokens=(1, 2, 3),
        loss_mask=(0, 1, 1),
        response_length=2,
        reward=1.0,
        status=Status.COMPLETED,
    )
    for step in (1, 2):
        logger.log(step, {"reward/mean": 0.1 * step, "time/generate_s": 1.0, "time/train_s": 2.0})
        logger.log_samples(step, [sample], decode=lambda ids: "x" * len(ids))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rows[0]["response"] == "xx"
    assert rows[1]["step"] == 2
    written = {p.name for p in plot_run(tmp_path)}
    assert {"reward.png", "phases.png"} <= written
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 1000
