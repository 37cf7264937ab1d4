"""What a built-in engine's start costs, fresh and from the engine forkserver (issue 46: the
main suite starts about a hundred engines).

    OMP_NUM_THREADS=1 python scripts/bench_engine_start.py [--model DIR] [--forks 3]

Prints, in one process and one run:
- fresh: an engine started by the launcher (`rollouts.engine.launch.spawn`: the die-with-parent
  shim, then exec), timed to its first 200 from /health, and the CPU seconds the process used;
- preload: the CPU the forkserver (`rollouts/forkserver/`) spent on its imports, once;
- forked: an engine the same launcher asks of that forkserver, timed the same way; then the
  ratio of the two CPU costs. (The forkserver needs one thread: OMP_NUM_THREADS=1 keeps numpy's
  OpenBLAS pool from starting.)"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx


def wait_healthy(url: str, started: float, timeout_s: float = 120.0) -> float:
    while time.monotonic() - started < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url}: no 200 from /health in {timeout_s} s")


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fresh(model: Path, log_dir: Path) -> tuple[float, float]:
    """An engine started by the launcher (`spawn`: the die-with-parent shim, then exec)."""
    from rollouts.engine.launch import engine_spec, spawn, wait_healthy_sync

    started = time.monotonic()
    proc = spawn(engine_spec(model, log_path=str(log_dir / "fresh.log")))
    try:
        wait_healthy_sync(proc, timeout_s=120.0)
        return time.monotonic() - started, process_cpu_s(proc.process.pid)
    finally:
        proc.kill()


def forked(model: Path, log_dir: Path) -> tuple[float, float]:
    """An engine the launcher asks of the forkserver (main sets `$ROLLOUTS_FORKSERVER`)."""
    from rollouts.engine.launch import engine_spec, spawn, wait_healthy_sync
    from rollouts.forkserver import ForkedProcess

    started = time.monotonic()
    proc = spawn(engine_spec(model, log_path=str(log_dir / "forked.log")))
    assert isinstance(proc.process, ForkedProcess), "the forkserver refused (see its log)"
    try:
        wait_healthy_sync(proc, timeout_s=120.0)
        return time.monotonic() - started, process_cpu_s(proc.process.pid)
    finally:
        proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny model built here")
    parser.add_argument("--forks", type=int, default=3)
    args = parser.parse_args()
    from rollouts.engine.launch import ENGINE_PRELOAD, engine_env
    from rollouts.forkserver import ENV_VAR, start_server

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from rollouts.models.tiny import TinyModelSpec, make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny", TinyModelSpec())
        fresh_wall, cpu = fresh(model, Path(tmp))
        print(f"fresh:   ready in {fresh_wall:.2f} s, CPU {cpu:.2f} s")
        sock = Path(tmp) / "engines.sock"
        server = start_server(
            str(sock), engine_env(), str(Path(tmp) / "forkserver.log"), ENGINE_PRELOAD
        )
        os.environ[ENV_VAR] = str(sock)
        cpus = []
        for i in range(args.forks):
            wall, fork_cpu = forked(model, Path(tmp))
            cpus.append(fork_cpu)
            if i == 0:
                print(f"preload: CPU {process_cpu_s(server.pid):.2f} s (the forkserver, once)")
            print(f"forked:  ready in {wall:.2f} s, CPU {fork_cpu:.2f} s")
        server.terminate()
        mean = sum(cpus) / len(cpus)
        print(
            f"fresh / forked CPU: {cpu / mean:.1f}x (the preload pays for itself from the 2nd fork)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
