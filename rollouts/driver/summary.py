"""The end of a run, as a newcomer reads it: plots written, and a short summary of what happened.

    [train] RL: 40 steps in 52m10s; held-out accuracy 0.210 -> 0.460 (best 0.480 at step 35)
    [train] failed:     12 rollout sample(s) in 3 step(s) (reward non_finite 8, ...): never ...
    [train] failed:     held-out at step 40 (over the 6 scored samples; 2 failed: reward raised 2)
    [train] run dir:    runs/x  (config.json, metrics.jsonl, rollouts.jsonl)
    [train] checkpoint: runs/x/checkpoints/rl/step_000040/model  (an HF model directory)
    [train] plots:      runs/x/plots  (accuracy.png, reward.png, ...)

`finish_run` prints these lines and writes the plots.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollouts.failures import counts_from_metrics, describe_counts
from rollouts.trainer.checkpoint import read_best

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"  # a LoRA run's (trainer/lora.py)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PhaseSummary:
    """What one phase (SFT or RL) did, from its metrics file."""

    name: str
    steps: int
    before: float | None = None  # held-out accuracy at step 0 (RL) / first eval loss (SFT)
    after: float | None = None
    best: tuple[int, float] | None = None  # (step, value) of the best held-out accuracy


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_phase(
    name: str, rows: list[dict[str, Any]], key: str, *, higher_is_better: bool = True
) -> PhaseSummary | None:
    """The phase's step count and `key` (e.g. "eval/accuracy") at its start, end and best.

    "Before" is the step-0 value (RL and SFT evaluate before their first step); a
    lower-is-better key (a loss) of an older run, first evaluated after some steps, takes its
    first evaluation instead. A single evaluation after step 0 is no "before" (None).
    """
    if not rows:
        return None
    steps = max(int(r.get("step", 0)) for r in rows)
    points = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
    if not points:
        return PhaseSummary(name=name, steps=steps)
    first_step, first_value = points[0]
    evaluated_before = first_step == 0 or (not higher_is_better and len(points) > 1)
    first = first_value if evaluated_before else None  # one late evaluation is no "before"
    after = points[-1][1] if points[-1][0] > 0 else None
    sign = 1.0 if higher_is_better else -1.0
    best = max(points, key=lambda p: (sign * p[1], -p[0])) if len(points) > 1 else None
    return PhaseSummary(name=name, steps=steps, before=first, after=after, best=best)


def format_duration(seconds: float) -> str:
    """'52m10s', '1h02m', '8s'."""
    assert seconds >= 0, f"{seconds=} must be >= 0"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def phase_line(p: PhaseSummary, metric: str, wall_s: float | None) -> str:
    """'RL: 40 steps in 52m10s; held-out accuracy 0.210 -> 0.460 (best 0.480 at step 35)'."""
    line = f"{p.name}: {p.steps} steps"
    line += f" in {format_duration(wall_s)}" if wall_s is not None else ""
    if p.before is None and p.after is not None:
        line += f"; {metric} {p.after:.3f} (no evaluation before training)"
    elif p.before is not None or p.after is not None:
        line += f"; {metric} {_fmt(p.before)} -> {_fmt(p.after)}"
        if p.best is not None and p.best[1] != p.after:
            line += f" (best {p.best[1]:.3f} at step {p.best[0]})"
    return line


def eval_failures_note(row: Mapping[str, Any]) -> str:
    """' (over the 6 scored samples; 2 failed: reward non_finite 2)' for an evaluation's
    metrics with FAILED samples; '' without."""
    failed = row.get("eval/failed")
    if not isinstance(failed, int | float) or not failed:
        return ""
    scored = int(row.get("eval/scored", 0))
    why = describe_counts(counts_from_metrics(row, "eval"))
    return f" (over the {scored} scored samples; {int(failed)} failed: {why})"


def failure_summary(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What failed in an RL run, from its metrics lines: the training rollouts' FAILED samples
    by reason (never trained on), and the last evaluation's (its accuracy is over the rest)."""
    counts: collections.Counter[str] = collections.Counter()
    steps = 0
    for row in rows:
        if int(row.get("step", 0)) > 0:
            found = counts_from_metrics(row, "rollout")
            counts.update(found)
            steps += bool(found)
    lines = []
    if counts:
        total = sum(counts.values())
        lines.append(
            f"failed:     {total} rollout sample(s) in {steps} step(s) ({describe_counts(counts)})"
            ": never trained on; their errors are in rollouts.jsonl"
        )
    evals = [r for r in rows if isinstance(r.get("eval/failed"), int | float)]
    if evals and evals[-1]["eval/failed"]:
        last = evals[-1]
        step = int(last.get("step", 0))
        lines.append(f"failed:     held-out at step {step}{eval_failures_note(last)}")
    return lines


def summary_lines(
    run_dir: Path,
    phases: list[tuple[PhaseSummary, str]],
    wall_s: float,
    checkpoint: Path | None,
    plots: list[Path],
    plot_error: str = "",
    best: dict[str, Any] | None = None,
    failures: Sequence[str] = (),
) -> list[str]:
    """The summary as lines (everything comes in as arguments; it only looks which run files
    exist). `best` is the checkpoints' best.json record, shown when it is not the last one;
    `failures` are `failure_summary`'s lines."""
    lines = [phase_line(p, metric, None) for p, metric in phases]
    lines += failures
    lines.append(f"wall time:  {format_duration(wall_s)}")
    files = (
        "config.json",
        "metrics.jsonl",
        "rollouts.jsonl",
        "eval_rollouts.jsonl",
        "sft_metrics.jsonl",
    )
    present = [n for n in files if (run_dir / n).is_file()]
    present += ["engines/ (the built-in engines' logs)"] if (run_dir / "engines").is_dir() else []
    lines.append(f"run dir:    {run_dir}  ({', '.join(present)})")
    lora = checkpoint is not None and (checkpoint / ADAPTER_DIR).is_dir()
    if checkpoint is not None and lora:
        adapter = checkpoint / ADAPTER_DIR
        lines.append(f"checkpoint: {adapter}  (a LoRA adapter: PeftModel.from_pretrained)")
    if checkpoint is not None and (not lora or (checkpoint / MODEL_DIR).is_dir()):
        model = checkpoint / MODEL_DIR
        lines.append(f"checkpoint: {model}  (AutoModelForCausalLM.from_pretrained loads it)")
    if best is not None and checkpoint is not None and best["name"] != checkpoint.name:
        where = checkpoint.parent / str(best["name"]) / (ADAPTER_DIR if lora else MODEL_DIR)
        lines.append(f"best:       {where}  ({best['metric']} {float(best['value']):.3f})")
    if plots:
        names = ", ".join(p.name for p in plots)
        lines.append(f"plots:      {plots[0].parent}  ({names})")
    elif plot_error:
        lines.append(f"plots:      none ({plot_error})")
    return lines


def write_plots(run_dir: Path) -> tuple[list[Path], str]:
    """`rollouts plot RUN_DIR`'s PNGs, or ([], why not) when there are no RL metrics or no
    matplotlib (the `plot` extra)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return [], "no RL metrics"
    try:
        from rollouts.driver.plot import plot_run

        return plot_run(run_dir), ""
    except ImportError as err:
        missing = err.name or "matplotlib"
        return [], f"{missing} is not installed: pip install matplotlib"


def finish_run(
    run_dir: Path, wall_s: float, checkpoint: Path | None, *, plots: bool = True
) -> list[str]:
    """Write the plots (unless `plots` is off) and print the summary of the run in `run_dir`;
    return the lines."""
    if plots:
        written, why = write_plots(run_dir)
    else:
        written, why = [], f"logging.plots = false; `rollouts plot {run_dir}` writes them"
    phases = []
    sft_rows = _rows(run_dir / "sft_metrics.jsonl")
    sft = summarize_phase("SFT", sft_rows, "sft/eval_loss", higher_is_better=False)
    if sft is not None:
        phases.append((sft, "held-out loss"))
    rl_rows = _rows(run_dir / "metrics.jsonl")
    rl = summarize_phase("RL", rl_rows, "eval/accuracy")
    if rl is not None:
        phases.append((rl, "held-out accuracy"))
    best = read_best(checkpoint.parent) if checkpoint is not None else None
    failures = failure_summary(rl_rows)
    lines = summary_lines(run_dir, phases, wall_s, checkpoint, written, why, best, failures)
    print("[train] ---- summary ----", flush=True)
    for line in lines:
        print(f"[train] {line}", flush=True)
    return lines
