"""`rollouts plot RUN_DIR`: PNG plots of a run's metrics.jsonl (needs matplotlib, the `plot` extra).

One PNG per panel: reward, accuracy, KL, entropy, response length, the learning signal (the
share of groups whose rewards are all equal, pass@k), the advantages, and the phase-time
breakdown (stacked bars of generate / reward / logprobs / train / checkpoint / sync / idle).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PANELS = {
    "reward": ("reward/mean", "eval/accuracy"),
    "accuracy": ("eval/accuracy", "reward/accuracy"),
    "kl": ("train/kl", "train/ppo_kl"),
    "entropy": ("train/entropy",),
    "response_length": ("rollout/response_length_mean",),
    "loss": ("train/loss", "sft/loss", "sft/eval_loss"),
    "signal": ("groups/all_equal_frac", "groups/pass_at_k", "groups/all_correct_frac"),
    "advantages": ("adv/abs_mean", "adv/std", "adv/zero_frac", "reward/spread_mean"),
}
PHASES = ("generate", "reward", "logprobs", "train", "checkpoint", "sync", "idle")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per panel that has data into RUN_DIR/plots; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written: list[Path] = []
    for name, keys in PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        for key in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
                drawn += 1
        if drawn:
            ax.set_xlabel("step")
            ax.set_title(name)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / f"{name}.png", dpi=100)
            written.append(out_dir / f"{name}.png")
        plt.close(fig)
    written += _plot_phases(rows, out_dir, plt)
    return written


def _plot_phases(rows: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
    steps = [r["step"] for r in rows if any(f"time/{p}_s" in r for p in PHASES)]
    if not steps:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(steps)
    phase_rows = [r for r in rows if r["step"] in set(steps)]
    for phase in PHASES:
        values = [float(r.get(f"time/{phase}_s", 0.0)) for r in phase_rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per phase")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "phases.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts plot`."""
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    """Write the plots and list them."""
    for path in plot_run(args.run_dir):
        print(path)
    return 0
