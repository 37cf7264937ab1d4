"""Where a test run's CPU goes: every process it starts, by kind and by test.

    python scripts/ci_profile.py [--top 30] [--json OUT] [-- COMMAND ...]

Runs COMMAND (default: `bash scripts/test.sh -q`) and samples /proc every 0.25 s meanwhile: each
process's command line, the test that started it (PYTEST_CURRENT_TEST in its environment, which
pytest sets for the test running and children inherit) and its CPU seconds (user + system, all
threads). Then it prints the CPU by kind of process (engine, driver, trainer child, torchrun rank,
vLLM server, pytest worker, ...) with how many started, and by test file and test. `times` in
.ci/run counts only the children a shell waited for, so it misses the processes a test starts in
their own session (vLLM's engine core and worker); this counts them.

A process that lives less than one sampling period may be missed, and one killed between two
samples loses up to 0.25 s of its CPU: the totals are a lower bound. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HZ = os.sysconf("SC_CLK_TCK")
PERIOD_S = 0.25
KINDS = (  # (what the command line holds, the kind); the first that matches
    ("exec(eval(sys.stdin", "pytest worker (xdist)"),
    ("rollouts.engine", "built-in engine"),
    ("process_child", "trainer child"),
    ("torch.distributed.run", "torchrun"),
    ("bin/torchrun", "torchrun"),
    ("rollouts.cli train", "driver (rank)"),
    ("train.py", "driver"),
    ("vllm.entrypoints", "vLLM API server"),
    ("VLLM::EngineCore", "vLLM engine core"),
    ("VLLM::Worker", "vLLM worker"),
    ("multiprocessing", "python multiprocessing child"),
    ("pytest", "pytest"),
)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _stat(pid: str) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, CPU seconds) of `pid`, or None when it is gone."""
    try:
        text = _read(f"/proc/{pid}/stat").decode()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ


def _identity(pid: str) -> tuple[str, str]:
    """(command line, the test that started it) of `pid`; empty strings when unreadable."""
    try:
        cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        env = _read(f"/proc/{pid}/environ").split(b"\0")
    except OSError:
        return "", ""
    test = next(
        (e[20:].decode(errors="replace") for e in env if e.startswith(b"PYTEST_CURRENT_TEST=")), ""
    )
    return cmd.strip(), test.rsplit(" (", 1)[0]


def sample(root_pid: int, stop: threading.Event, seen: dict) -> None:
    """Every process that descends from `root_pid`: its first command line after exec (a fork
    holds its parent's until then), its test and its highest CPU reading."""
    parents: dict[int, int] = {}
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            stat = _stat(pid)
            if stat is None:
                continue
            ppid, start, cpu = stat
            parents[int(pid)] = ppid
            key = (int(pid), start)
            record = seen.get(key)
            if record is None:
                node = int(pid)
                while node not in (root_pid, 0, 1) and node in parents:
                    node = parents[node]
                if node != root_pid:
                    continue
                record = seen[key] = {"pid": int(pid), "cmd": "", "test": "", "cpu": 0.0}
            record["cpu"] = max(record["cpu"], cpu)
            cmd, test = _identity(pid)
            if cmd and cmd != record["cmd"]:  # the first reading, or the one after exec
                record["cmd"], record["test"] = cmd, test or record["test"]
        stop.wait(PERIOD_S)


def kind(cmd: str) -> str:
    return next((name for mark, name in KINDS if mark in cmd), cmd.split(" ")[0][-40:] or "?")


def report(records: list[dict], wall_s: float, top: int) -> None:
    total = sum(r["cpu"] for r in records)
    cores = len(os.sched_getaffinity(0))
    print(f"\n[ci-profile] {len(records)} processes, {total:.0f} CPU s in {wall_s:.0f} s")
    print(f"[ci-profile] {total / wall_s:.2f} of {cores} cores busy on average")
    tables = {
        "kind": lambda r: kind(r["cmd"]),
        "test file": lambda r: r["test"].split("::")[0] or "(no test)",
        "test": lambda r: r["test"] or "(no test)",
    }
    for title, key in tables.items():
        rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for record in records:
            rows[key(record)][0] += 1
            rows[key(record)][1] += record["cpu"]
        print(f"\n  CPU s  procs  by {title}")
        for name, (n, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"  {cpu:6.1f}  {n:5d}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    parser.add_argument("--json", type=Path, help="write every process's record here")
    parser.add_argument("command", nargs="*", default=["bash", "scripts/test.sh", "-q"])
    args = parser.parse_args()
    started = time.monotonic()
    proc = subprocess.Popen(args.command, cwd=ROOT)
    seen: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(proc.pid, stop, seen), daemon=True)
    sampler.start()
    rc = proc.wait()
    stop.set()
    sampler.join()
    records = list(seen.values())
    report(records, time.monotonic() - started, args.top)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
