"""Benchmark: the built-in engine (`rollouts serve`) against the real vLLM (CPU build), one run.

The RL-shaped batch: 16 prompts x 8 samples = 128 sequences, temperature 1 with a seed per
sample, EOS ignored so every sequence has exactly `--new-tokens` (64) tokens, the logprob of each
sampled token returned. Each engine gets it the way the rollout manager sends it: the built-in
server one batch request per group (`SGLangEngine.generate_many`), vLLM one request per sample
(`VLLMEngine.generate`, all 128 at once). Each computes on one core, the same one (`--core`,
default 1): vLLM as `scripts/serve_vllm.sh` starts it (compiled, its default level; its worker
bound there, `VLLM_CPU_OMP_THREADS_BIND`), the built-in engine as a run places it
(`rollouts serve --cpus` with one torch thread; with two threads on a shared 2-core box its
OpenMP spin-waits make it up to 30x slower whenever anything else runs). Rounds alternate, and
the engine not being measured is stopped (SIGSTOP: an idle vLLM's polling loops would otherwise
take CPU from the built-in engine's rounds). Printed: start-up time, each round,
the medians and the ratio built-in / vLLM of the batch time (above 1: vLLM is faster).

    .venv/bin/python scripts/bench_vllm.py                  # the demo's tiny model
    .venv/bin/python scripts/bench_vllm.py --model smollm2  # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import trio

from rollouts.engine.launch import engine_process
from rollouts.inference.http import HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.sources import fetch_source
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.wire.generation import GenerateRequest, SamplingParams
from rollouts.wire.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = HttpOptions(timeout_s=600.0, max_retries=0)


def model_dir(name: str, tmp: Path) -> Path:
    if name == "smollm2":
        return fetch_source("smollm2-135m-instruct")
    spec = TinyModelSpec(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=512)
    return make_tiny_model(tmp / "tiny", spec)  # the demo's shape (head_dim 32)


def requests(vocab: int, prompts: int, group: int, new: int, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(16, 48)))
        for i in range(group):
            sampling = SamplingParams(
                max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=seed * 1000 + p * 16 + i
            )
            out.append(GenerateRequest(input_ids=prompt, sampling=sampling, rid=f"b{p}-{i}"))
    return out


async def builtin_batch(engine: SGLangEngine, reqs: list[GenerateRequest], group: int) -> int:
    tokens = 0

    async def one(chunk: list[GenerateRequest]) -> None:
        nonlocal tokens
        done = await engine.generate_many(chunk)  # awaited before `tokens` is read
        tokens += sum(len(c.output_ids) for c in done)

    async with trio.open_nursery() as nursery:
        for i in range(0, len(reqs), group):
            nursery.start_soon(one, reqs[i : i + group])
    return tokens


async def vllm_batch(engine: VLLMEngine, reqs: list[GenerateRequest]) -> int:
    tokens = 0

    async def one(r: GenerateRequest) -> None:
        nonlocal tokens
        done = await engine.generate(r.input_ids, r.sampling, rid=r.rid)
        tokens += len(done.output_ids)

    async with trio.open_nursery() as nursery:
        for r in reqs:
            nursery.start_soon(one, r)
    return tokens


def start_vllm(model: Path, log: Path, core: int) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts/serve_vllm.sh"), str(model), str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1.0)


def frozen(pid: int, stop: bool, group: bool) -> None:
    """Stop or continue a server (vLLM: its whole process group; built-in: one process)."""
    (os.killpg if group else os.kill)(pid, signal.SIGSTOP if stop else signal.SIGCONT)
    time.sleep(0.5 if not stop else 0.1)


async def bench(args: argparse.Namespace, model: Path, vllm_url: str, vllm_pgid: int) -> None:
    from transformers import AutoTokenizer

    vocab = min(len(AutoTokenizer.from_pretrained(model)), 2000)
    started = time.monotonic()
    async with engine_process(model, max_batch=128, torch_threads=1, cpus=(args.core,)) as proc:
        print(f"built-in engine ready in {time.monotonic() - started:.1f}s")
        builtin = SGLangEngine(proc.url, options=OPTIONS)
        real = VLLMEngine(vllm_url, options=OPTIONS)
        warm = requests(vocab, 2, args.group, 8, seed=99)
        await builtin_batch(builtin, warm, args.group)
        await vllm_batch(real, warm)
        times: dict[str, list[float]] = {"builtin": [], "vllm": []}
        for r in range(args.rounds):
            reqs = requests(vocab, args.prompts, args.group, args.new_tokens, seed=r)
            for name in ("builtin", "vllm") if r % 2 == 0 else ("vllm", "builtin"):
                idle = (vllm_pgid, True) if name == "builtin" else (proc.process.pid, False)
                frozen(idle[0], True, idle[1])
                t = time.monotonic()
                if name == "builtin":
                    tokens = await builtin_batch(builtin, reqs, args.group)
                else:
                    tokens = await vllm_batch(real, reqs)
                times[name].append(time.monotonic() - t)
                frozen(idle[0], False, idle[1])
                assert tokens == len(reqs) * args.new_tokens, f"{name}: {tokens} tokens"
                took = times[name][-1]
                print(f"round {r} {name:8s} {took:7.2f}s  {tokens / took:8.0f} tok/s")
        await builtin.aclose()
        await real.aclose()
    b, v = statistics.median(times["builtin"]), statistics.median(times["vllm"])
    n = args.prompts * args.group
    print(f"median batch of {n} x {args.new_tokens} tokens: built-in {b:.2f}s, vLLM {v:.2f}s")
    print(f"ratio built-in / vLLM: {b / v:.2f} (above 1: vLLM is faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--core", type=int, default=1, help="the core both engines compute on")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        log = ROOT / "runs" / f"bench_vllm-{args.model}.log"  # kept: vLLM says why it failed
        log.parent.mkdir(exist_ok=True)
        proc, url, ready_s = start_vllm(model, log, args.core)
        print(f"vLLM ({args.model}) ready in {ready_s:.1f}s")
        try:
            trio.run(bench, args, model, url, os.getpgid(proc.pid))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


if __name__ == "__main__":
    main()
