"""Same seed, same metrics: the check a refactor must pass (torchtitan's rule: loss-identical).

    python scripts/same_seed.py run  OUT_DIR [--config configs/demo-cpu.toml] [--set K=V ...]
                                          [--forkserver]
    python scripts/same_seed.py diff A_DIR B_DIR

`run` trains `--mode sft+rl` in sync mode (the mode that stays exactly on-policy) into OUT_DIR and
writes OUT_DIR/comparable.json: every line of sft_metrics.jsonl and metrics.jsonl without its
timings (seconds, rates, engine load). `diff` compares two of them and prints every key that
differs, with the largest absolute difference. The one figure that is not bit-equal between runs is
`train/logprob_mismatch`: the built-in engine batches requests as they arrive, and a row's floats
depend on its batch (on a CPU with bf16 units the demo's RL engine runs bf16: two runs of one commit
differed by up to 1.1e-5 in it; in fp32 they were equal); `diff` reports it apart, within
BATCH_FLOATS, and exits 1 only on other differences: every other key (losses, rewards, eval, KL)
must be equal. `--forkserver` runs it as the test suite does: its engines and trainer process forked
by two forkservers (`rollouts/forkserver/`; one torch thread a process, `OMP_NUM_THREADS=1`, which
the servers need: compare with a run that has it too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH_FLOATS = {"train/logprob_mismatch": 1e-4}
FILES = ("sft_metrics.jsonl", "metrics.jsonl")


def _comparable(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("time/", "perf/", "memory/"))
        and not re.search(r"_s(_|$)", k)
        and k != "engines/load"
    }


def _forkservers(tmp: str) -> list[subprocess.Popen]:
    """The test suite's two servers (tests/conftest.py), named in this process's environment."""
    sys.path.insert(0, str(ROOT))
    from rollouts.engine.launch import ENGINE_PRELOAD, engine_env
    from rollouts.forkserver import ENV_VAR, start_server
    from rollouts.openmp import short_spin_waits
    from tests.conftest import PRELOAD

    assert os.environ.get("OMP_NUM_THREADS") == "1", "--forkserver: set OMP_NUM_THREADS=1"
    short_spin_waits()
    engines, programs = f"{tmp}/engines.sock", f"{tmp}/programs.sock"
    servers = [
        start_server(engines, engine_env(), f"{tmp}/engines.log", ENGINE_PRELOAD),
        start_server(programs, dict(os.environ), f"{tmp}/programs.log", PRELOAD),
    ]
    os.environ[ENV_VAR] = os.pathsep.join([engines, programs])
    return servers


def run(out: Path, config: str, sets: list[str], forkserver: bool = False) -> None:
    out = out.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        servers = _forkservers(tmp) if forkserver else []
        try:
            _train(out, config, sets)
        finally:
            for server in servers:
                server.terminate()


def _train(out: Path, config: str, sets: list[str]) -> None:
    overrides = [f"run.output_dir={json.dumps(str(out / 'run'))}", 'rollout.mode="sync"', *sets]
    command = [sys.executable, "integration_training/train.py", "--mode", "sft+rl"]
    command += ["--config", config] + [a for s in overrides for a in ("--set", s)]
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
    (out / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"train.py failed ({done.returncode}); see {out / 'train.log'}")
    rows = {
        name: [
            _comparable(json.loads(line)) for line in (out / "run" / name).read_text().splitlines()
        ]
        for name in FILES
    }
    (out / "comparable.json").write_text(json.dumps(rows, indent=1, sort_keys=True))
    last = rows["metrics.jsonl"][-1]
    print(f"{out}: {len(rows['sft_metrics.jsonl'])} SFT + {len(rows['metrics.jsonl'])} RL lines;")
    print(f"  last RL line: {json.dumps({k: last[k] for k in sorted(last)[:12]})}")


def diff(a: Path, b: Path) -> int:
    ra, rb = (json.loads((d / "comparable.json").read_text()) for d in (a, b))
    other: dict[str, float] = {}
    batch: dict[str, float] = {}
    first: dict[str, int] = {}  # file -> the step of its first line that differs
    for name in FILES:
        if len(ra[name]) != len(rb[name]):
            print(f"{name}: {len(ra[name])} lines against {len(rb[name])}")
            return 1
        for la, lb in zip(ra[name], rb[name], strict=True):
            for key in sorted(la.keys() | lb.keys()):
                va, vb = la.get(key), lb.get(key)
                if va == vb:
                    continue
                both_numbers = isinstance(va, int | float) and isinstance(vb, int | float)
                gap = abs(va - vb) if both_numbers else float("inf")
                into = batch if key in BATCH_FLOATS else other
                into[f"{name}:{key}"] = max(into.get(f"{name}:{key}", 0.0), gap)
                if into is other:
                    first.setdefault(name, la.get("step", -1))
    lines = sum(len(ra[name]) for name in FILES)
    for key, gap in sorted(batch.items()):
        print(f"batch floats  {key}: max |a-b| = {gap:.3g}")
    for key, gap in sorted(other.items()):
        print(f"DIFFERS       {key}: max |a-b| = {gap:.3g}")
    for name in FILES:
        same = f"differ from step {first[name]} on" if name in first else "are the same"
        print(f"{name}: {len(ra[name])} lines, {same}")
    print(f"{lines} lines compared: {len(other)} keys differ beyond the batch floats")
    too_far = [k for k, g in batch.items() if g > BATCH_FLOATS[k.split(":", 1)[1]]]
    return 1 if other or too_far else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--config", default="configs/demo-cpu.toml")
    r.add_argument("--set", action="append", default=[], dest="sets")
    r.add_argument("--forkserver", action="store_true", help="fork as the test suite does")
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.config, args.sets, args.forkserver)
    else:
        sys.exit(diff(args.a, args.b))


if __name__ == "__main__":
    main()
