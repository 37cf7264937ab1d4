"""The runs around a chaos run (`scripts/chaos.py`): the base model, the unbroken run, the
train.py command both share, and the report.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos_checks import Check
from chaos_faults import Fault, tagged_processes

from rollouts.forkserver import popen

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integration_training" / "train.py"


def train_command(config: str, sets: list[str]) -> list[str]:
    """train.py --mode rl on `config` with `sets` (KEY=VALUE overrides)."""
    command = [sys.executable, str(TRAIN), "--mode", "rl", "--config", config]
    return command + [a for s in sets for a in ("--set", s)]


def train(config: str, sets: list[str], log: Path, mode: str = "rl") -> None:
    """One whole train.py run (the base model's SFT, the unbroken RL run); exits on failure."""
    command = train_command(config, sets)
    command[command.index("rl")] = mode
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        # forked where a forkserver runs (the test suite's): no seconds of imports
        code = popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).wait()
    if code != 0:
        sys.exit(f"train.py --mode {mode} failed (exit {code}); see {log}")


def common_sets(args: argparse.Namespace, model: str) -> list[str]:
    """The overrides both RL runs share: sync mode, a trainer process, every sample logged."""
    data = args.out / "data"
    return [
        f"run.seed={args.seed}",
        'rollout.mode="sync"',
        'training.trainer_process="on"',
        f"training.rl_steps={args.steps}",
        f"model.path={json.dumps(model)}",
        f"data.sft_path={json.dumps(str(data / 'sft.jsonl'))}",
        f"data.train_path={json.dumps(str(data / 'train.jsonl'))}",
        f"data.eval_path={json.dumps(str(data / 'eval.jsonl'))}",
        "logging.rollouts_per_step=1000000",
        f"checkpoint.every={args.checkpoint_every}",
        "checkpoint.keep_last=2",
        "engines.health_interval_s=0.5",
        "engines.stall_timeout_s=3.0",
        *args.sets,
    ]


def base_model(args: argparse.Namespace) -> str:
    """The RL runs' starting model: `--sft-steps` of SFT (kept per seed), or the config's."""
    if args.base_model:
        return str(Path(args.base_model).resolve())
    if args.sft_steps == 0:
        return str(args.out / "base-model")
    base = args.out / f"base-seed{args.seed}-sft{args.sft_steps}"
    model = base / "run" / "checkpoints" / "sft" / f"step_{args.sft_steps:06d}" / "model"
    if not (model / "config.json").is_file():
        sets = common_sets(args, str(base / "tiny-model"))
        sets += [
            f"training.sft_steps={args.sft_steps}",
            f"run.output_dir={json.dumps(str(base / 'run'))}",
        ]
        train(args.config, sets, args.out / "logs" / f"{base.name}.log", mode="sft")
    return str(model)


def clean_run(args: argparse.Namespace, sets: list[str]) -> Path:
    """The unbroken run (kept: run again only when its settings change)."""
    run = args.out / f"clean-seed{args.seed}" / "run"
    key = json.dumps(sets)
    done = run.parent / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("sets") == key:
        return run
    name = json.dumps(f"chaos-clean-{args.seed}")
    train(
        args.config,
        [*sets, f"run.output_dir={json.dumps(str(run))}", f"run.name={name}"],
        run.parent / "train.log",
    )
    done.write_text(json.dumps({"sets": key}))
    return run


def wait_for_clean(run: Path, steps: int, deadline: float) -> None:
    """Wait (until `deadline`) for an unbroken run made elsewhere (`--clean-run`) to end: its
    last checkpoint written and its lock released."""
    final = run / "checkpoints" / "rl" / f"step_{steps:06d}" / "manifest.json"
    while time.monotonic() < deadline and not (final.is_file() and not (run / "run.lock").exists()):
        time.sleep(1.0)


def leftovers(chaos: Any, shm_before: set[str]) -> list[Check]:
    """Nothing of the run left in /dev/shm (weight copies, locks) or the process table."""
    shm = {p.name for p in Path("/dev/shm").iterdir()} - shm_before
    ours = sorted(n for n in shm if chaos.tag in n)
    root = chaos.sync_root  # where the weight copies went ($ROLLOUTS_WEIGHT_COPIES or /dev/shm)
    ours += [str(p) for p in (root, root.with_name(root.name + ".lock")) if p.exists()]
    others = sorted(shm - set(ours))
    detail = (
        f"left: {ours}"
        if ours
        else "nothing of the run" + (f" (other users' new entries: {others[:5]})" if others else "")
    )
    procs = tagged_processes(chaos.tag)
    return [
        Check(name="nothing left in /dev/shm", ok=not ours, detail=detail),
        Check(
            name="no process left",
            ok=not procs,
            detail=f"left: {procs}" if procs else "no engine, trainer or driver of the run alive",
        ),
        Check(
            name="no leak or hang along the way",
            ok=not chaos.findings,
            detail="; ".join(chaos.findings) or "none",
        ),
    ]


def report(
    args: argparse.Namespace, chaos: Any, faults: list[Fault], checks: list[Check], full_disk: str
) -> None:
    """Print the faults by kind, the resumes and the checks; keep them in OUT/report.json."""
    planned = collections.Counter(f.kind for f in faults)
    done = collections.Counter(r["kind"] for r in chaos.injected if "skipped" not in r)
    print(
        f"\nchaos run: seed {args.seed}, {args.steps} steps, {len(faults)} faults planned, "
        f"{sum(done.values())} injected"
    )
    print(f"full disk: {full_disk}")
    for kind in sorted(planned):
        print(f"  {kind:28s} {done[kind]}/{planned[kind]}")
    print("faults in order:")
    for r in chaos.injected:
        what = (
            f"skipped: {r['skipped']}"
            if "skipped" in r
            else f"at {r['moment']}, pid {r['pid']}: {r['detail']}"
        )
        print(f"  run {r['run']:2d} {r['kind']:28s} {what}")
    print(f"runs of train.py: {len(chaos.runs)} ({len(chaos.runs) - 1} resumes)")
    for i, r in enumerate(chaos.runs):
        resumed = f"resumed from step {r.get('resumed_from')}" if i else "fresh"
        args_ = " ".join(r["args"])
        steps = f"steps logged {r['from_step']} -> {r.get('to_step')}"
        print(f"  run {i:2d} {args_:40s} {resumed}, {steps}, exit {r.get('code')}")
        if r.get("error"):
            print(f"         {r['error'][:300]}")
    print("checks:")
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    record = {"seed": args.seed, "steps": args.steps, "faults": chaos.injected, "runs": chaos.runs}
    record["checks"] = [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]
    (args.out / "report.json").write_text(json.dumps(record, indent=1))
