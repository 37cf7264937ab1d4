"""Benchmark: a shipped config against the same config with its speed keys removed (the defaults).

Issue 50's "fast by default": a config written from the schema defaults, with no precision or
speed key, should run within 5% of the shipped config. This writes the shipped config without
`SPEED_KEYS` (a TOML of its own), then runs train.py on each in alternating rounds on the same
box and prints, for each, the whole run's wall time, the RL phase's median step time, the
held-out accuracy at the end and what the "auto" keys resolved to (the run's `[train] auto:`
line). The ratio is shipped / defaults per round and its median: >= 0.95 meets the goal.

    python scripts/bench_defaults.py [--config configs/demo-cpu.toml] [--rounds 3] [--set K=V]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# every key that chooses speed or precision; what is left describes the task and the algorithm
SPEED_KEYS = (
    "model.attn_implementation",
    "model.dtype",
    "training.micro_batch_tokens",
    "training.micro_batch_layout",
    "training.logprob_chunk_size",
    "training.autocast",
    "training.sft_autocast",
    "engines.builtin.dtype",
    "engines.builtin.autocast",
    "engines.builtin.max_batch",
    "weight_sync.dtype",
)


def strip(table: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """Remove `keys` (dotted) from `table` in place; the keys that were there."""
    removed = []
    for key in keys:
        *path, last = key.split(".")
        node = table
        for part in path:
            node = node.get(part, {})
        if last in node:
            del node[last]
            removed.append(key)
    return removed


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML here")


def to_toml(table: dict[str, Any], prefix: str = "") -> str:
    """A TOML text of `table` (scalars and lists of scalars, nested tables)."""
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    lines += [f"{k} = {_value(v)}" for k, v in scalars.items()]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += ["", to_toml(v, f"{prefix}.{k}" if prefix else k)]
    return "\n".join(lines)


def run(config: Path, mode: str, out: Path, sets: list[str]) -> dict[str, Any]:
    """train.py on `config`; wall time, RL median step time, last accuracy, the auto line."""
    keys = [f"run.output_dir='{out}'", "run.overwrite=true", *sets]
    command = [sys.executable, "integration_training/train.py", "--mode", mode]
    command += ["--config", str(config)] + [a for k in keys for a in ("--set", k)]
    log = out.with_suffix(".log")
    start = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"{config} failed ({done.returncode}): see {log}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r][2:]
    accs = [r[k] for r in rows for k in r if k == "eval/accuracy"]
    auto = [x for x in log.read_text().splitlines() if x.startswith("[train] auto:")]
    return {
        "wall_s": wall,
        "rl_step_s": statistics.median(steps) if steps else float("nan"),
        "accuracy": accs[-1] if accs else float("nan"),
        "auto": auto[0].removeprefix("[train] auto: ") if auto else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo-cpu.toml")
    parser.add_argument("--mode", default="sft+rl")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-defaults")
    parser.add_argument("--set", action="append", default=[], help="K=V for both runs")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    table = tomllib.loads(args.config.read_text())
    removed = strip(table, SPEED_KEYS)
    defaults = args.work / f"{args.config.stem}-defaults.toml"
    defaults.write_text(f"# {args.config} without {', '.join(removed)}\n{to_toml(table)}\n")
    print(f"removed from {args.config.name}: {', '.join(removed)}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"shipped": [], "defaults": []}
    for r in range(args.rounds):
        order = ["shipped", "defaults"] if r % 2 == 0 else ["defaults", "shipped"]
        for name in order:
            config = args.config if name == "shipped" else defaults
            res = run(config, args.mode, args.work / f"{name}-{r}", args.set)
            results[name].append(res)
            print(
                f"round {r} {name:<9} wall {res['wall_s']:7.1f} s  RL step "
                f"{res['rl_step_s']:.3f} s  accuracy {res['accuracy']:.3f}",
                flush=True,
            )
    print(f"\ndefaults resolved to: {results['defaults'][0]['auto']}")
    print(f"shipped config's auto keys: {results['shipped'][0]['auto'] or '(none)'}")
    for key in ("wall_s", "rl_step_s"):
        ratios = [
            s[key] / d[key] for s, d in zip(results["shipped"], results["defaults"], strict=True)
        ]
        rounds = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{key}: shipped / defaults median {statistics.median(ratios):.3f} ({rounds})")


if __name__ == "__main__":
    main()
