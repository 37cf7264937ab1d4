"""What a built-in engine's start costs, and what a preloaded parent would save (issue 46: the main
suite starts about 108 engines, half its CPU).

    python scripts/bench_engine_start.py [--model DIR] [--forks 3]

Prints, in one process and one run:
- fresh: an engine started by the launcher (`rollouts.engine.launch.spawn`), timed to its
  first 200 from /health, and the CPU seconds the process used;
- preload: importing what the engine imports (torch, transformers' Llama, the engine's app) in
  this process once, as a forkserver would;
- forked: an engine forked from this preloaded process (`rollouts.engine.cli.run` in the child),
  timed the same way; then the ratio of the two CPU costs.

A measurement for a design not built yet: the child here is a bare fork (its output discarded; no
process group, no death signal, no exit status for the launcher).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import httpx

from rollouts.wire.ports import free_port


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


def preload() -> tuple[float, float]:
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    import torch  # noqa: F401
    import trio  # noqa: F401
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401

    import rollouts.engine.app
    import rollouts.engine.cli  # noqa: F401

    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.monotonic() - started, cpu


def forked(model: Path) -> tuple[float, float]:
    from rollouts.engine import cli

    port = free_port()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: the engine, its output discarded
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        os._exit(cli.run(parser.parse_args(["--model", str(model), "--port", str(port)])))
    try:
        ready = wait_healthy(f"http://127.0.0.1:{port}", started)
        return ready, process_cpu_s(pid)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny model built here")
    parser.add_argument("--forks", type=int, default=3)
    args = parser.parse_args()
    wall, pre = preload()  # first: nothing heavy is imported yet
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from rollouts.models.tiny import TinyModelSpec, make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny", TinyModelSpec())
        fresh_wall, cpu = fresh(model, Path(tmp))
        print(f"fresh:   ready in {fresh_wall:.2f} s, CPU {cpu:.2f} s")
        print(f"preload: {wall:.2f} s, CPU {pre:.2f} s (once per preloaded parent)")
        cpus = []
        for _ in range(args.forks):
            wall, fork_cpu = forked(model)
            cpus.append(fork_cpu)
            print(f"forked:  ready in {wall:.2f} s, CPU {fork_cpu:.2f} s")
        mean = sum(cpus) / len(cpus)
        print(
            f"fresh / forked CPU: {cpu / mean:.1f}x (the preload pays for itself from the 2nd fork)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
