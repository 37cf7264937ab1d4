"""Benchmark: the built-in engine with freed memory kept for reuse against glibc's defaults.

Two `rollouts serve` processes on the same model, dtype and cores: "keep" (what the server sets
now, `rollouts/heap.py`) and "system" (`ROLLOUTS_MALLOC=system`: glibc's defaults, as before).
Each round sends both the RL batch of `scripts/bench_vllm.py` (16 chat word problems x 8 seeded
samples, temperature 1, the end of sequence honoured, at most 64 new tokens, a batch request per
group), in turns that alternate, the idle server stopped (SIGSTOP). Printed per round: seconds,
generated tokens per second, and the server's minor page faults (`/proc/PID/stat`); then each
side's median, and keep / system in tokens per second (above 1: keeping is faster).

    .venv/bin/python scripts/bench_engine_malloc.py --model smollm2 --dtype bfloat16 \\
        [--cores 1 | --cores all] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import trio
from bench_vllm import OPTIONS, builtin_batch, frozen, model_dir, prompt_ids, requests
from transformers import AutoTokenizer

from rollouts.engine.launch import engine_process
from rollouts.inference.sglang import SGLangEngine

MODES = ("keep", "system")


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (field 10 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


@contextlib.asynccontextmanager
async def server(model: Path, mode: str, args: argparse.Namespace):
    """A built-in server whose malloc is `mode` (the variable is read when it starts)."""
    saved = os.environ.pop("ROLLOUTS_MALLOC", None)
    if mode == "system":
        os.environ["ROLLOUTS_MALLOC"] = "system"
    threads = len(args.cores) if args.cores else os.cpu_count() or 1
    kwargs = {"cpus": args.cores} if args.cores else {}
    try:
        spawned = engine_process(
            model, max_batch=128, torch_threads=threads, dtype=args.dtype, **kwargs
        )
        proc = await spawned.__aenter__()
    finally:
        os.environ.pop("ROLLOUTS_MALLOC", None)
        if saved is not None:
            os.environ["ROLLOUTS_MALLOC"] = saved
    try:
        yield proc
    finally:
        await spawned.__aexit__(None, None, None)


async def bench(args: argparse.Namespace, model: Path) -> dict[str, list[tuple[float, float]]]:
    tok = AutoTokenizer.from_pretrained(model)
    async with server(model, "keep", args) as keep, server(model, "system", args) as system:
        procs = {"keep": keep, "system": system}
        engines = {m: SGLangEngine(p.url, options=OPTIONS) for m, p in procs.items()}
        for m in MODES:
            info = await engines[m].http.json("GET", "/server_info")
            assert info.get("malloc") == m, f"{m} server reports malloc {info.get('malloc')!r}"
        warm = requests(prompt_ids(tok, 2, seed=99), args.group, 8, seed=99)
        for engine in engines.values():
            await builtin_batch(engine, warm, args.group)
        out: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            reqs = requests(prompt_ids(tok, args.prompts, seed=r), args.group, args.new_tokens, r)
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                idle = procs["system" if mode == "keep" else "keep"].process.pid
                frozen((idle, False), True)
                pid = procs[mode].process.pid
                faults, t = minor_faults(pid), time.monotonic()
                tokens = await builtin_batch(engines[mode], reqs, args.group)
                took, faults = time.monotonic() - t, minor_faults(pid) - faults
                frozen((idle, False), False)
                out[mode].append((tokens / took, faults))
                print(
                    f"round {r} {mode:6s} {took:6.2f}s {tokens:6d} tok {tokens / took:6.0f} tok/s "
                    f"{faults:8d} page faults"
                )
        for engine in engines.values():
            await engine.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cores", default="1", help="a core list (e.g. 1), or 'all': unpinned")
    args = parser.parse_args()
    args.cores = () if args.cores == "all" else tuple(int(c) for c in args.cores.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        out = trio.run(bench, args, model_dir(args.model, Path(tmp)))
    where = f"cores {list(args.cores)}" if args.cores else "the whole box"
    print(f"{args.model}, {args.dtype}, {where}, {args.rounds} rounds (medians):")
    med = {m: statistics.median(r for r, _ in out[m]) for m in MODES}
    for m in MODES:
        faults = statistics.median(f for _, f in out[m])
        print(f"  {m:6s} {med[m]:6.0f} tok/s, {faults:8.0f} page faults a round")
    print(f"keep / system (tok/s): {med['keep'] / med['system']:.3f}")


if __name__ == "__main__":
    main()
