"""Benchmark: RL steps in synchronous vs asynchronous mode on the demo config.

Runs the same RL phase twice in one process (same tiny model, same data, same seed), once with
rollout.mode = "sync" and once with "async", and prints samples/s, the ratio async/sync, the
mean time of each phase per step, and the fraction of step time that is not model compute
(model compute = the generate, logprobs and train phases; the rest is reward scoring, weight
sync, checkpoints, batching and waiting).

    python scripts/bench_rl_step.py [--steps 8] [--skip 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import trio

from rollouts.config import load_config
from rollouts.training.run import rl_phase
from rollouts.training.run_setup import (
    StopFlag,
    prepare_base_model,
    prepare_data,
    prepare_run_dir,
)

PHASES = ("generate", "logprobs", "train", "sync", "eval", "checkpoint", "idle")
COMPUTE = ("generate", "logprobs", "train")


def run_mode(mode: str, steps: int, work: Path, overrides: list[str]) -> list[dict]:
    """Run `steps` RL steps in `mode`; the metrics rows (one per step)."""
    config = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.toml",
        [
            f"run.output_dir='{work / mode}'",
            f"model.path='{work / 'model'}'",
            f"training.rl_steps={steps}",
            f"rollout.mode='{mode}'",
            "training.eval_every=0",
            "checkpoint.every=0",
            "logging.console=false",
            "data.eval_size=8",
            *overrides,
        ],
    )
    run_dir = prepare_run_dir(config, "bench", resume=False)
    prepare_data(config)
    model = prepare_base_model(config)
    started = time.monotonic()
    trio.run(rl_phase, config, run_dir, model, False, StopFlag())
    print(f"[{mode}] {steps} steps in {time.monotonic() - started:.1f}s", flush=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["step"] >= 1]


def summarise(rows: list[dict], skip: int) -> dict[str, float]:
    """samples/s over the measured steps and the mean seconds of each phase."""
    rows = rows[skip:]
    total_s = sum(r["perf/step_time_s"] for r in rows)
    samples = sum(r["perf/samples_per_s"] * r["perf/step_time_s"] for r in rows)
    out = {"samples_per_s": samples / total_s, "step_s": total_s / len(rows)}
    for phase in PHASES:
        out[phase] = sum(r.get(f"time/{phase}_s", 0.0) for r in rows) / len(rows)
    compute = sum(out[p] for p in COMPUTE)
    out["not_compute_frac"] = max(out["step_s"] - compute, 0.0) / out["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        work = Path(tmp)
        results = {
            m: summarise(run_mode(m, args.steps, work, args.overrides), args.skip)
            for m in ("sync", "async")
        }
    print(f"\n{'phase (s/step)':<18}" + "".join(f"{m:>10}" for m in results))
    for key in ("step_s", *PHASES):
        print(f"{key:<18}" + "".join(f"{results[m][key]:>10.3f}" for m in results))
    for m, r in results.items():
        print(
            f"{m}: {r['samples_per_s']:.2f} samples/s, "
            f"not model compute {100 * r['not_compute_frac']:.1f}% of step time"
        )
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async / sync samples/s ratio: {ratio:.2f}x")


if __name__ == "__main__":
    main()
