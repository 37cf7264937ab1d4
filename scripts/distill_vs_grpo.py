"""On-policy distillation against GRPO from the same base model, seed by seed.

    python scripts/distill_vs_grpo.py OUT [--seeds 0 1 2] [--grpo-steps 24] [--distill-steps 12]
        [--eval-every 2] [--teacher runs/smollm2-teacher-model] [--top-k K] [--only METHOD]
        [--set KEY=VALUE ...]

For each seed it runs, one after the other on the whole machine:
  - GRPO: configs/smollm2-lora-cpu.toml for --grpo-steps steps;
  - distillation: configs/smollm2-distill-cpu.toml (the teacher at --teacher) for
    --distill-steps steps;
both evaluated every --eval-every steps on the same 60 held-out prompts. It prints each run's
held-out accuracy by step, its wall time, the teacher's accuracy (measured by the distillation
run before its first step) and the first step at which each run reaches 90% of it. Each run's
directory is OUT/<method>-s<seed>; its console is OUT/<method>-s<seed>.log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integration_training" / "train.py"
CONFIGS = {"grpo": "configs/smollm2-lora-cpu.toml", "distill": "configs/smollm2-distill-cpu.toml"}


def run(method: str, seed: int, steps: int, args: argparse.Namespace) -> dict:
    """One train.py run; its eval accuracies by step, the teacher's, and its wall time."""
    out = Path(args.out) / f"{method}-s{seed}"
    sets = [
        f"run.seed={seed}",
        f"run.output_dir={out}",
        f"training.rl_steps={steps}",
        f"training.eval_every={args.eval_every}",
    ]
    if method == "distill":
        sets.append(f"teacher.path={args.teacher}")
        if args.top_k is not None:
            sets.append(f"algorithm.distill.top_k={args.top_k}")
    sets += args.set
    cmd = [sys.executable, str(TRAIN), "--mode", "rl", "--config", CONFIGS[method]]
    for s in sets:
        cmd += ["--set", s]
    started = time.monotonic()
    with open(f"{out}.log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{method} seed {seed} failed ({done.returncode}): see {out}.log")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    acc = {m["step"]: m["eval/accuracy"] for m in lines if "eval/accuracy" in m}
    key = "teacher/eval/accuracy"
    teacher = next((m[key] for m in lines if key in m), None)
    return {"acc": acc, "teacher": teacher, "wall_s": wall}


def first_reaching(acc: dict[int, float], target: float) -> int | None:
    return next((step for step, a in sorted(acc.items()) if a >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--grpo-steps", type=int, default=24)
    parser.add_argument("--distill-steps", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--teacher", default="runs/smollm2-teacher-model")
    parser.add_argument("--only", choices=sorted(CONFIGS), help="run one method only")
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="algorithm.distill.top_k of the distillation runs (default: the config's)",
    )
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {m: {} for m in CONFIGS}
    for seed in args.seeds:
        for method, steps in (("distill", args.distill_steps), ("grpo", args.grpo_steps)):
            if args.only and method != args.only:
                continue
            results[method][seed] = r = run(method, seed, steps, args)
            print(f"{method} seed {seed}: {r['acc']} in {r['wall_s']:.0f} s", flush=True)
    teachers = [r["teacher"] for r in results["distill"].values() if r["teacher"] is not None]
    if not teachers:
        return
    teacher = teachers[0]
    target = 0.9 * teacher
    print(f"\nteacher held-out accuracy {teacher:.3f}; 90% of it: {target:.3f}")
    print("seed | method  | start -> last (steps) | first step >= 90% | wall")
    for seed in args.seeds:
        for method in CONFIGS:
            r = results[method].get(seed)
            if r is None:
                continue
            acc = r["acc"]
            steps = sorted(acc)
            reach = first_reaching(acc, target)
            print(
                f"{seed:4d} | {method:7s} | {acc[steps[0]]:.3f} -> {acc[steps[-1]]:.3f} "
                f"({steps[-1]}) | {reach if reach is not None else 'never':>17} | "
                f"{r['wall_s'] / 60:.1f} min"
            )


if __name__ == "__main__":
    main()
