"""Benchmark: what the content check of each weight sync costs, as a fraction of the RL step.

Runs `train.py --mode rl` (default: the CPU demo config in sync mode, so every step waits for its
sync) and reads each step's metrics: the trainer's probe forward (`sync/probe_s`) plus the
slowest engine's probe request (`sync/check_s_max`), over the step's wall time
(`perf/step_time_s`). Prints each step's fraction and the median (steps 2.. : the first step
carries the start-up). Extra `--set` overrides go to train.py, e.g. against a real vLLM:

    .venv/bin/python scripts/bench_weight_check.py
    .venv/bin/python scripts/bench_weight_check.py --config configs/smollm2-cpu.toml --steps 4 \
        --set engines.kind='"vllm"' --set 'engines.urls=["http://127.0.0.1:8000"]'
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/demo-cpu.toml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"training.rl_steps={args.steps}",
            "training.eval_every=0",
            'rollout.mode="sync"',
            "checkpoint.every=0",
            f'run.output_dir="{tmp}/run"',
            *args.overrides,
        ]
        cmd = [sys.executable, str(ROOT / "integration_training/train.py"), "--mode", "rl"]
        cmd += ["--config", args.config]
        for o in overrides:
            cmd += ["--set", o]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"train.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        rows = [json.loads(x) for x in (Path(tmp) / "run/metrics.jsonl").read_text().splitlines()]
    fractions = []
    for row in rows:
        if row["step"] < 1 or "sync/check_s_max" not in row:
            continue
        cost = row["sync/check_s_max"] + row.get("sync/probe_s", 0.0)
        step = row["perf/step_time_s"]
        print(
            f"step {row['step']:3d}: check {1000 * cost:6.1f} ms (trainer "
            f"{1000 * row.get('sync/probe_s', 0.0):5.1f}, engine "
            f"{1000 * row['sync/check_s_max']:5.1f}) of a {step:5.2f} s step "
            f"({100 * cost / step:4.2f}%), gap {row['sync/content_gap_max']:.1e}"
        )
        if row["step"] >= 2:
            fractions.append(cost / step)
    print(f"median check / step: {100 * statistics.median(fractions):.2f}% over {len(fractions)}")


if __name__ == "__main__":
    main()
