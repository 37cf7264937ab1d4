"""Chaos run: a sync RL run broken by random faults must end as if it had never been broken.

    python scripts/chaos.py [--seed 0] [--steps 60] [--faults 20] [--out DIR]
        [--config configs/demo-cpu.toml] [--sft-steps 300] [--set KEY=VALUE ...]

1. The base model: `--sft-steps` SFT steps of the config (once per seed, kept in OUT/base-*);
   0 starts RL from the config's own model (the tests' tiny one).
2. The unbroken run: `train.py --mode rl` in sync mode with training in a trainer process,
   every sample logged to rollouts.jsonl and a checkpoint every `--checkpoint-every` steps.
3. The same run on a tmpfs of `--tmpfs-mb` (the full-disk fault fills it), broken by `--faults`
   faults (`chaos_faults.py`: SIGKILL of the driver, the trainer child or an engine, at random
   moments, mid-checkpoint and mid-sync included; SIGSTOP of an engine; a corrupted or truncated
   file in the newest checkpoint; a full disk), resumed after each as a user would: `--resume`,
   then the fallback the error names for a corrupt checkpoint.
4. The checks (`chaos_checks.py`): final weights bit-equal, each step once with equal metrics,
   every prompt used as often, metrics.jsonl whole, nothing left in /dev/shm or the process table.
The report prints the faults by kind, the resumes and each check; OUT/report.json keeps it. Exit
code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from chaos_checks import (
    Check,
    check_metrics_equal,
    check_metrics_whole,
    check_prompts,
    check_weights,
)
from chaos_faults import (
    BETWEEN_RUNS,
    ENGINE_MARK,
    KINDS,
    TAG_VAR,
    TRAINER_MARK,
    Fault,
    checkpoint_in_progress,
    damage_checkpoint,
    fill_disk,
    last_logged_step,
    mount_tmpfs,
    newest_checkpoint,
    pids_marked,
    plan_faults,
    send,
    sync_watcher,
    tagged_processes,
    unmount,
    wait_for,
    wait_processes_gone,
)
from chaos_runs import (
    ROOT,
    base_model,
    clean_run,
    common_sets,
    leftovers,
    report,
    train_command,
    wait_for_clean,
)

from rollouts.forkserver import ForkedProcess, popen

STOP_ON_DISK_FULL_S = 180.0  # a run on a full disk must stop (with its error) within this
GONE_S = 20.0  # a dead driver's children (engines, trainer) must be gone within this
MAX_FAILED_STARTS = 3  # a run that fails this often in a row, with no fault, ends the chaos run


class Chaos:
    """One chaos run: its train.py invocations, faults and findings."""

    def __init__(self, args: argparse.Namespace, sets: list[str], disk: Path) -> None:
        self.args, self.sets, self.disk = args, sets, disk
        self.run_dir = disk / "run"
        self.ckpt_root = self.run_dir / "checkpoints" / "rl"
        self.tag = f"chaos-{args.seed}-{uuid.uuid4().hex[:8]}"
        self.rng = random.Random(args.seed + 1)
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.runs: list[dict[str, Any]] = []
        self.injected: list[dict[str, Any]] = []
        self.findings: list[str] = []
        self.fallback: list[str] = []
        from rollouts.weights.copies import run_sync_root

        self.sync_root = run_sync_root("", self.tag, self.run_dir)

    # -- train.py ------------------------------------------------------------------------------
    def start(self) -> None:
        """train.py on the chaos run: fresh the first time, then `--resume` (and a fallback)."""
        resume = ["--resume", *self.fallback] if self.runs else []
        sets = [*self.sets, f"run.output_dir={json.dumps(str(self.run_dir))}"]
        sets.append(f"run.name={json.dumps(self.tag)}")
        log = self.args.out / "logs" / f"chaos-{len(self.runs):02d}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = train_command(self.args.config, sets) + resume
        env = dict(os.environ, **{TAG_VAR: self.tag})
        with log.open("w") as out:  # forked where a forkserver runs (the test suite's)
            self.proc = popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.runs.append({"log": str(log), "args": resume, "from_step": self.last_step()})
        self.fallback = []

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def last_step(self) -> int:
        return last_logged_step(self.run_dir / "metrics.jsonl")

    def finish(self, timeout_s: float) -> int | None:
        """Wait for train.py (bounded); record its end, its children gone, the way to resume."""
        assert self.proc is not None, "no run to wait for"
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        run = self.runs[-1]
        text = Path(run["log"]).read_text(errors="replace")
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        resumed = re.findall(r"resuming from (\S+) \(step (\d+)\)", text)
        run.update(code=code, to_step=self.last_step(), error=errors[-1][:400] if errors else "")
        run["resumed_from"] = resumed[-1][1] if resumed else None
        left = wait_processes_gone(self.tag, GONE_S)
        if left:
            self.findings.append(f"run {len(self.runs) - 1} (exit {code}): left {left}")
            for pid in left:
                send(pid, signal.SIGKILL)
        step = re.search(r"--resume-step (\d+)", errors[-1] if errors else "")  # the fallbacks
        if step is not None:
            by_step = len(self.runs) % 2 == 1
            self.fallback = (
                ["--resume-step", step.group(1)]
                if by_step
                else ["--set", 'checkpoint.on_corrupt="fall_back"']
            )
        return code

    # -- faults --------------------------------------------------------------------------------
    def moment(self, fault: Fault) -> str:
        """Wait for the fault's moment in the live run; what it was ("" when the run ended)."""
        alive = self.alive
        if "mid_checkpoint" in fault.kind or fault.kind in BETWEEN_RUNS:
            if fault.kind in BETWEEN_RUNS:  # stopped right after a new checkpoint, one intact
                seen = newest_checkpoint(self.ckpt_root)  # one left (a user's way back)

                def fresh() -> bool:
                    newest = newest_checkpoint(self.ckpt_root)
                    older = len(list(self.ckpt_root.glob("step_*/manifest.json"))) >= 2
                    return newest not in (None, seen) and older

                return "after a checkpoint" if wait_for(fresh, alive, 0.01) else ""
            found = wait_for(lambda: checkpoint_in_progress(self.ckpt_root), alive, 0.0005)
            return "a checkpoint being written" if found else ""
        if "mid_sync" in fault.kind:
            probe = sync_watcher(self.sync_root)
            state: list[str] = []
            found = wait_for(lambda: bool(state.append(probe()) or state[-1]), alive, 0.0005)
            return f"a weight sync ({state[-1]})" if found else ""
        # no later than two steps before the end, at once there: a fault planned later would
        # find the run completed (a fast run finishes a step within the planned delay)
        latest = self.args.steps - 2
        target = min(self.last_step() + fault.after_steps, latest)
        if not wait_for(lambda: self.last_step() >= target, alive, 0.02):
            return ""
        delay = fault.delay_s if target < latest else 0.0
        time.sleep(delay)
        return f"{delay:.2f} s after step {self.last_step()} was logged"

    def victim(self, fault: Fault) -> int | None:
        """The pid the fault hits: the driver, the trainer child or an engine."""
        assert self.proc is not None, "no run"
        mark = TRAINER_MARK if "trainer" in fault.kind else ENGINE_MARK
        if "driver" in fault.kind or fault.kind in BETWEEN_RUNS:
            return self.proc.pid
        found: list[int] = []
        wait_for(lambda: bool(found.extend(pids_marked(self.tag, mark)) or found), self.alive, 0.05)
        return self.rng.choice(found) if found else None

    def inject(self, fault: Fault) -> bool:
        """Inject `fault` into the live run, then wait as its kind needs; False when the run
        ended before the fault's moment (it is tried again in the next run)."""
        moment = self.moment(fault)
        pid = self.victim(fault) if moment else None
        if pid is None:
            return False
        record = {"kind": fault.kind, "run": len(self.runs) - 1, "moment": moment, "pid": pid}
        self.runs[-1]["faulted"] = True
        if fault.kind == "full_disk":
            filler = fill_disk(self.disk)
            record["detail"] = self.after_full_disk(filler)
        elif fault.kind == "stop_engine":
            send(pid, signal.SIGSTOP)
            if fault.cont_after_s is not None:
                time.sleep(fault.cont_after_s)
                send(pid, signal.SIGCONT)
            record["detail"] = (
                f"SIGCONT after {fault.cont_after_s} s" if fault.cont_after_s else "never continued"
            )
        else:
            record["detail"] = "SIGKILL" if send(pid, signal.SIGKILL) else "already gone"
        self.injected.append(record)
        if fault.kind in BETWEEN_RUNS:
            self.finish(60.0)
            self.damage(fault, record)
        elif "engine" not in fault.kind and self.alive() and self.finish(120.0) is None:
            self.findings.append(
                f"{fault.kind}: train.py (pid {self.proc.pid}) still runs 120 s later"
            )
            send(self.proc.pid, signal.SIGKILL)
            self.finish(60.0)
        return True

    def after_full_disk(self, filler: Path) -> str:
        """The run on a full disk must stop with its error; then the space comes back."""
        code = self.finish(STOP_ON_DISK_FULL_S)
        if code is None:
            self.findings.append(f"full disk: train.py still ran {STOP_ON_DISK_FULL_S:.0f} s later")
        filler.unlink()
        if code is None:
            return "the run went on (space freed)"
        return f"stopped with exit {code}: {self.runs[-1]['error'][:200] or 'no error line'}"

    def damage(self, fault: Fault, record: dict[str, Any]) -> None:
        """Corrupt or truncate one file of the newest checkpoint (the run is stopped)."""
        assert not self.alive(), "damage a checkpoint only between runs"
        ckpt = newest_checkpoint(self.ckpt_root)
        how = "corrupt" if fault.kind == "corrupt_checkpoint" else "truncate"
        record["detail"] = "SIGKILL, then " + (
            damage_checkpoint(ckpt, self.rng, how) if ckpt else "no checkpoint to damage"
        )

    def skip(self, fault: Fault, why: str) -> None:
        self.injected.append({"kind": fault.kind, "skipped": why, "run": len(self.runs) - 1})

    # -- the whole run -------------------------------------------------------------------------
    def run(self, faults: list[Fault], deadline: float) -> None:
        """Start, break and resume the run until every fault is injected and it completes."""
        pending = collections.deque((fault, 0) for fault in faults)
        failed_in_a_row = 0  # runs that failed with no fault injected in them
        while time.monotonic() < deadline:
            if not self.alive():
                if self.proc is not None and "code" not in self.runs[-1]:
                    self.finish(5.0)  # it ended by itself (after an engine fault)
                last = self.runs[-1] if self.runs else {}
                if last.get("code") == 0 and self.last_step() >= self.args.steps:
                    for fault, _ in pending:
                        self.skip(fault, "the run completed first")
                    return
                failed = self.runs and last.get("code") != 0 and not last.get("faulted")
                failed_in_a_row = failed_in_a_row + 1 if failed else 0
                if failed_in_a_row >= MAX_FAILED_STARTS:
                    self.findings.append(
                        f"{failed_in_a_row} resumes in a row failed: {last['error']}"
                    )
                    return
                self.start()
            if pending:
                fault, tries = pending.popleft()
                if self.inject(fault):
                    continue
                if tries < 2:
                    pending.appendleft((fault, tries + 1))  # tried again in the next run
                else:
                    self.skip(fault, "three runs ended before its moment")
                continue
            self.finish(max(1.0, deadline - time.monotonic()))
        if self.alive():
            send(self.proc.pid, signal.SIGKILL)
            self.finish(60.0)
        self.findings.append("the chaos run did not finish before its time bound")
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo-cpu.toml"))
    parser.add_argument("--out", type=Path, default=None, help="default: /tmp/rollouts-chaos-SEED")
    parser.add_argument("--sft-steps", type=int, default=300, help="0: RL from the config's model")
    parser.add_argument("--base-model", default="", help="an HF model dir: no SFT (--sft-steps)")
    parser.add_argument(
        "--clean-run",
        default="",
        help="the unbroken run's directory, made (or being made) elsewhere with the same settings",
    )
    parser.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--tmpfs-mb", type=int, default=256)
    parser.add_argument("--timeout-min", type=float, default=60.0)
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("chaos.py: SIGTERM"))  # clean up first
    args.out = (args.out or Path(f"/tmp/rollouts-chaos-{args.seed}")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.timeout_min
    sets = common_sets(args, base_model(args))
    clean = Path(args.clean_run).resolve() if args.clean_run else clean_run(args, sets)
    disk = args.out / f"chaos-seed{args.seed}"
    why = mount_tmpfs(disk, args.tmpfs_mb)
    full_disk = (
        f"a {args.tmpfs_mb} MB tmpfs on {disk}"
        if not why
        else f"no tmpfs ({why}): full-disk faults left out"
    )
    asked = tuple(args.kinds.split(",")) if args.kinds else KINDS
    assert set(asked) <= set(KINDS), f"--kinds {sorted(set(asked) - set(KINDS))}: not in {KINDS}"
    kinds = tuple(k for k in asked if not why or k != "full_disk")
    faults = plan_faults(args.seed, args.faults, kinds)
    shm_before = {p.name for p in Path("/dev/shm").iterdir()}
    chaos = Chaos(args, sets, disk)
    try:
        chaos.run(faults, deadline)
        wait_for_clean(clean, args.steps, deadline)
        final = chaos.ckpt_root / f"step_{args.steps:06d}"
        checks = [
            Check(
                name="the run completed",
                ok=final.is_dir(),
                detail=f"{final.name} exists" if final.is_dir() else f"no {final}",
            )
        ]
        if final.is_dir():
            checks.append(check_weights(clean / "checkpoints" / "rl" / final.name, final))
        checks.append(check_metrics_whole(chaos.run_dir, args.steps))
        checks += check_metrics_equal(clean, chaos.run_dir)
        checks.append(check_prompts(clean, chaos.run_dir))
        checks += leftovers(chaos, shm_before)
        keep = args.out / "chaos-files"
        keep.mkdir(exist_ok=True)
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            if (chaos.run_dir / name).exists():
                (keep / name).write_bytes((chaos.run_dir / name).read_bytes())
    finally:
        if chaos.alive():
            send(chaos.proc.pid, signal.SIGKILL)
            chaos.proc.wait()
        for pid in tagged_processes(chaos.tag):  # only after an interrupted chaos run
            send(pid, signal.SIGKILL)
        if not why:
            unmount(disk)
    report(args, chaos, faults, checks, full_disk)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
