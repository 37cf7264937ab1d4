"""`rollouts show RUN_DIR` on the shared finished tiny run (sft+rl; conftest `finished_run`): its
sections and numbers are those of the run's files; a run still writing (a torn last line) shows;
a directory that is no run is an error naming the missing file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollouts.cli import main
from rollouts.driver.show_text import phase_lines, slowest_lines, step_table
from tests.training.conftest import FinishedRun


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _show(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str], str]:
    code = main(["show", *args, "--width", "200"])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _section(lines: list[str], title: str) -> list[str]:
    """The lines of the section whose title starts with `title` (up to the next blank line)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"== {title}"))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start + 1 : end]


def _table(lines: list[str]) -> dict[str, dict[str, str]]:
    """A table's cells by step (its first column) and header."""
    header = lines[0].split()
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in map(str.split, lines[1:])}


def test_show_prints_the_run_s_steps_phases_and_samples(
    finished_run: FinishedRun, capsys: pytest.CaptureFixture
) -> None:
    run = finished_run.run
    code, lines, err = _show(capsys, str(run))
    assert code == 0, err
    assert lines[0].startswith(f"run {run}  (config {finished_run.config}")
    assert lines[1:3] == [
        "SFT: step 6 of 6",
        "RL: step 3 of 3; grpo, sync mode, 2 groups x 2 samples a step",
    ]
    metrics = {r["step"]: r for r in _rows(run / "metrics.jsonl")}
    table = _table(_section(lines, "RL steps"))
    assert sorted(table) == ["0", "1", "2", "3"]
    for step in (1, 2, 3):
        row, cells = metrics[step], table[str(step)]
        assert cells["reward"] == f"{row['reward/mean']:.3f}"
        assert cells["flat"] == f"{row['groups/all_equal_frac']:.2f}"
        assert cells["step_s"] == f"{row['perf/step_time_s']:.2f}"
    assert table["3"]["eval_acc"] == f"{metrics[3]['eval/accuracy']:.3f}"
    assert "kl" not in table["1"]  # no KL in this run's algorithm: the column is left out
    sft = {r["step"]: r for r in _rows(run / "sft_metrics.jsonl")}
    sft_table = _table(_section(lines, "SFT steps"))
    assert sft_table["6"]["eval_acc"] == f"{sft[6]['sft/eval_accuracy']:.3f}"
    phases = {p.split()[0]: p.split() for p in _section(lines, "RL phases")[1:]}
    generate = sum(r["time/generate_s"] for r in metrics.values() if "time/generate_s" in r)
    assert phases["generate"][1] == f"{generate:.2f}"
    steps_s = sum(r["perf/step_time_s"] for r in metrics.values() if "perf/step_time_s" in r)
    assert phases["step"][3] == f"{steps_s:.2f}"  # "step (all phases)"
    held = _section(lines, "held-out evaluations")
    assert held[-1].startswith("step 3: 8 episodes, accuracy ")
    assert held[-1].endswith(f"{metrics[3]['eval/accuracy']:.3f}")
    samples = _rows(run / "rollouts.jsonl")
    slowest = _section(lines, "slowest sampled rollouts (every step")
    top = max(sum(r["timing"].values()) for r in samples)
    assert slowest[0].split()[:7] == [
        "step",
        "group",
        "prompt",
        "total_s",
        "queue_s",
        "generate_s",
        "reward_s",
    ]
    assert slowest[1].split()[3] == f"{top:.3f}" and len(slowest) == 1 + 5
    last = [r for r in samples if r["step"] == 3]
    assert f"== sampled rollouts of step 3 (2 of {len(last)})" in lines
    assert sum(line.startswith("-- step 3, group ") for line in lines) == 2


def test_show_picks_a_step_and_tolerates_a_run_still_writing(
    finished_run: FinishedRun, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "sft_metrics.jsonl", "rollouts.jsonl"):
        shutil.copy(finished_run.run / name, run / name if run.exists() else _mkdir(run) / name)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')  # the writer is mid-line
    code, lines, err = _show(capsys, str(run), "--step", "2", "--samples", "1")
    assert code == 0, err
    assert "(metrics.jsonl: its last line is incomplete, left out: a run still writing it)" in lines
    assert sorted(_table(_section(lines, "RL steps"))) == ["0", "1", "2", "3"]
    assert _section(lines, "slowest sampled rollouts (step 2")[1].split()[0] == "2"
    assert next(line for line in lines if line.startswith("-- step")).startswith("-- step 2, ")
    assert "held-out" not in "\n".join(lines)  # no eval_rollouts.jsonl: no section
    code, lines, _ = _show(capsys, str(run), "--step", "9")
    assert code == 0 and lines[-1] == "no sampled rollout of step 9 in rollouts.jsonl (steps 1..3)"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_a_directory_that_is_no_run_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    code, _, err = _show(capsys, str(tmp_path))
    assert code == 1
    assert err == (
        f"error: {tmp_path} is not a run directory: {tmp_path / 'config.json'} is missing "
        "(`rollouts train` writes it when a run starts, beside metrics.jsonl and "
        "sft_metrics.jsonl)\n"
    )
    code, _, err = _show(capsys, str(tmp_path / "nowhere"))
    assert code == 1 and err == f"error: {tmp_path / 'nowhere'}: no such directory\n"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    code, _, err = _show(capsys, str(tmp_path))
    assert code == 1 and f"{tmp_path / 'metrics.jsonl'}:2: not a JSON line" in err, err


def test_show_imports_no_torch(finished_run: FinishedRun) -> None:
    """A look at a run is quick: the command's module never loads torch."""
    code = (
        "import sys; from rollouts.cli import main; code = main(['show', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; raise SystemExit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(finished_run.run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "== RL steps" in done.stdout


def test_the_text_of_each_section() -> None:
    """Columns no row has are left out; a long run shows evenly spaced steps; a phase run
    beside the step is not a share of it; rows without times say so."""
    rows = [{"step": s, "reward/mean": s / 100, "perf/step_time_s": 2.0} for s in range(1, 41)]
    lines = step_table(rows, [("reward", "reward/mean", "{:.2f}"), ("kl", "train/kl", "{:.2f}")])
    assert lines[0].split() == ["step", "reward"]
    assert [line.split()[0] for line in lines[1:-1]][:3] == ["1", "3", "5"]
    assert lines[-2].split() == ["40", "0.40"] and lines[-1] == "(20 of 40 rows, evenly spaced)"
    timed = [
        {
            "step": 1,
            "perf/step_time_s": 4.0,
            "time/generate_s": 3.0,
            "time/train_s": 1.0,
            "time/generate_overlapped_s": 2.5,
        }
    ]
    phases = phase_lines(timed)
    assert phases[1].split() == ["generate", "3.00", "3.00", "75.0%"]
    assert phases[2].split() == ["generate_overlapped", "2.50", "2.50", "(beside)"]
    assert phases[-1].startswith("(beside: generation of the next batch")
    assert slowest_lines([{"step": 1}]) == [
        "(no per-sample times in rollouts.jsonl: a run from before they were recorded)"
    ]
