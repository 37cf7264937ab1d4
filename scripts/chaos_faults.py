"""The faults of `scripts/chaos.py`: what they are, when they land, and how they are injected.

A fault is planned (`plan_faults`, pure: the kinds and their moments drawn from the seed) and
then injected into a live run (SIGKILL / SIGSTOP of the driver, the trainer child or an engine,
a full disk) or between two runs (a corrupted or truncated file in the newest checkpoint). Each
live fault waits for its moment: a step logged (then a random delay), a checkpoint being
written (`.tmp-step_*` in the checkpoint directory) or a weight sync under way (a `.tmp-v_*`
or a new `v_*` copy in the run's weight-copy directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

FaultKind = Literal[
    "kill_driver",
    "kill_driver_mid_checkpoint",
    "kill_driver_mid_sync",
    "kill_trainer",
    "kill_trainer_mid_checkpoint",
    "kill_engine",
    "kill_engine_mid_sync",
    "stop_engine",
    "corrupt_checkpoint",
    "truncate_checkpoint",
    "full_disk",
]
KINDS: tuple[FaultKind, ...] = FaultKind.__args__  # type: ignore[attr-defined]
BETWEEN_RUNS: frozenset[str] = frozenset({"corrupt_checkpoint", "truncate_checkpoint"})
TRAINER_KINDS: frozenset[str] = frozenset({"kill_trainer", "kill_trainer_mid_checkpoint"})
MOMENT_WAIT_S = 120.0  # a moment (a step, a checkpoint, a sync) not seen in this long: missed
TAG_VAR = "ROLLOUTS_CHAOS_TAG"  # in the environment of train.py and so of every child
ENGINE_MARK = "rollouts.engine"
TRAINER_MARK = "rollouts.trainer.process_child"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One planned fault: its kind, the steps to wait after the last logged one, a delay, and
    (SIGSTOP) when to send SIGCONT (None: never, the hung-engine path ends the run)."""

    kind: FaultKind
    after_steps: int = 1
    delay_s: float = 0.0
    cont_after_s: float | None = None

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"{self.kind=} not in {KINDS}"
        assert self.after_steps >= 0, f"{self.after_steps=}"
        assert self.delay_s >= 0, f"{self.delay_s=}"


def plan_faults(seed: int, count: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """`count` faults drawn from `seed`: every kind of `kinds` once (when `count` allows), the
    rest at random, in a random order; each with its moment."""
    assert count >= 0, f"{count=}"
    assert kinds, "no fault kind to draw from"
    rng = random.Random(seed)
    chosen = list(kinds)[:count]
    chosen += [rng.choice(kinds) for _ in range(count - len(chosen))]
    rng.shuffle(chosen)
    faults = []
    for kind in chosen:
        stop = kind == "stop_engine"
        cont = rng.choice([None, rng.uniform(0.5, 2.0), rng.uniform(4.0, 8.0)]) if stop else None
        faults.append(
            Fault(
                kind=kind,  # type: ignore[arg-type]
                after_steps=rng.randint(0, 2),
                delay_s=round(rng.uniform(0.0, 1.5), 3),
                cont_after_s=None if cont is None else round(cont, 3),
            )
        )
    return faults


def tagged_processes(tag: str) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds `TAG_VAR=tag`: pid -> command."""
    found = {}
    needle = f"{TAG_VAR}={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if state != "Z":
            found[int(proc.name)] = command
    return found


def pids_marked(tag: str, mark: str) -> list[int]:
    """The tagged processes whose command line holds `mark` (an engine's, the trainer's)."""
    return sorted(pid for pid, cmd in tagged_processes(tag).items() if mark in cmd)


def wait_processes_gone(tag: str, timeout_s: float) -> dict[int, str]:
    """Poll until no tagged process is left (bounded); those still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def last_logged_step(metrics: Path) -> int:
    """The step of the last whole line of metrics.jsonl (-1: none yet)."""
    try:
        lines = metrics.read_bytes().split(b"\n")[:-1]  # a torn last line has no newline
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return -1


def wait_for(done: Callable[[], bool], alive: Callable[[], bool], poll_s: float) -> bool:
    """Poll `done` every `poll_s` until it holds (True) or the run ends or the bound passes."""
    deadline = time.monotonic() + MOMENT_WAIT_S
    while time.monotonic() < deadline and alive():
        if done():
            return True
        time.sleep(poll_s)
    return False


def checkpoint_in_progress(root: Path) -> bool:
    """A checkpoint is being written under `root` (its temporary directory exists)."""
    try:
        return any(e.name.startswith(".tmp-step_") for e in os.scandir(root))
    except OSError:
        return False


def sync_watcher(root: Path) -> Callable[[], str]:
    """A probe of a weight sync: "writing" while a `.tmp-v_*` copy exists, "loading" once a new
    `v_*` copy appeared (the engines are told to load it), else ""."""
    try:
        seen = {e.name for e in os.scandir(root) if e.name.startswith("v_")}
    except OSError:
        seen = set()

    def probe() -> str:
        try:
            names = [e.name for e in os.scandir(root)]
        except OSError:
            return ""
        if any(n.startswith(".tmp-v_") for n in names):
            return "writing"
        return "loading" if any(n.startswith("v_") and n not in seen for n in names) else ""

    return probe


def newest_checkpoint(root: Path) -> Path | None:
    """The newest `step_*` directory with a manifest under `root` (None: none)."""
    found = sorted(p for p in root.glob("step_*") if (p / "manifest.json").is_file())
    return found[-1] if found else None


def damage_checkpoint(ckpt: Path, rng: random.Random, how: str) -> str:
    """Corrupt (flip bytes, same size) or truncate (to half) one file of `ckpt`; says which."""
    assert how in ("corrupt", "truncate"), f"{how=}"
    files = sorted(f for f in ckpt.rglob("*") if f.is_file() and f.name != "manifest.json")
    assert files, f"{ckpt} holds no file"
    target = rng.choice([f for f in files if f.stat().st_size > 16] or files)
    size = target.stat().st_size
    if how == "truncate":
        os.truncate(target, size // 2)
        return f"{target.relative_to(ckpt.parent)}: truncated {size} -> {size // 2} bytes"
    at = rng.randrange(size // 2, size)  # past most headers: the data itself
    with open(target, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"{target.relative_to(ckpt.parent)}: byte {at} of {size} flipped"


def fill_disk(mount: Path) -> Path:
    """Fill the file system of `mount` with a filler file (every free byte); its path."""
    filler = mount / "chaos-filler"
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, free)
        chunk = b"\0" * (1 << 20)
        try:
            while True:  # whatever fallocate left (a few blocks)
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    return filler


def mount_tmpfs(where: Path, size_mb: int) -> str:
    """Mount a tmpfs of `size_mb` on `where`; "" when it worked, else why not."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    return "" if done.returncode == 0 else (done.stderr.strip() or f"mount exit {done.returncode}")


def unmount(where: Path) -> None:
    """Unmount `where` (a tmpfs this run mounted), retried while a dying process holds it."""
    for _ in range(50):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)


def send(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to `pid`; False when it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
