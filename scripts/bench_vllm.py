"""Benchmark: the built-in engine (`rollouts serve`) against the real vLLM (CPU build), one run.

The RL batch a run sends: 16 chat prompts (grade-school word problems in the model's own chat
template) x 8 samples = 128 sequences, temperature 1 with a seed per sample, the end of sequence
honoured, at most `--new-tokens` (64), the logprob of each sampled token returned. Each engine
gets it the way the rollout manager sends it: the built-in server one batch request per group
(`SGLangEngine.generate_many`), vLLM one request per sample (`VLLMEngine.generate`, all 128 at
once). Both serve `--dtype` weights (vLLM as `scripts/serve_vllm.sh` starts it: compiled, its
default level). The score is generated tokens per second (the two sample different tokens, so
their lengths differ a little; the mean length is printed).

Placement (`--cores`):
- one core (`--cores 1`, the default): each server's whole process tree on that core (vLLM's
  API server too, not only its worker), the built-in engine with one torch thread;
- the whole box (`--cores all`): nothing pinned; the built-in engine with a torch thread per
  core, vLLM with its own default binding (`--vllm-bind` overrides it, e.g. "0-1").
Rounds alternate, and the engine not being measured is stopped (SIGSTOP, its whole process
group: an idle vLLM's polling loops would otherwise take CPU from the built-in engine's rounds).

In the same run, with both servers stopped, the bare matmul rate of the model's linear shapes at
the decode batch (128 rows) in `--dtype` on the same cores (`scripts/matmul_rate.py`); each
engine's decode share is its model FLOP/s (2 x the matmul parameters a token) over that rate.

Printed: start-up times, each round, each engine's median, slowest round / median, its share of
the matmul rate, and the ratio built-in / vLLM of tokens per second (above 1: built-in faster).

    .venv/bin/python scripts/bench_vllm.py --model smollm2 [--dtype bfloat16] [--cores all]
    .venv/bin/python scripts/bench_vllm.py              # the demo's tiny model
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
import torch
import trio
from matmul_rate import decode_rate, pinned, shapes_of
from transformers import AutoConfig, AutoTokenizer

from rollouts.data.word_problems import problems, row
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
DECODE_ROWS = 128


def model_dir(name: str, tmp: Path) -> Path:
    if name == "smollm2":
        return fetch_source("smollm2-135m-instruct")
    spec = TinyModelSpec(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=512)
    return make_tiny_model(tmp / "tiny", spec)  # the demo's shape (head_dim 32)


def prompt_ids(tok, count: int, seed: int) -> list[tuple[int, ...]]:
    """`count` word problems, in the model's chat template where it has one."""
    rng = random.Random(seed)
    picked = rng.sample(problems(), count)
    out = []
    for kind, a, b in picked:
        question = row(kind, a, b, rng)["question"]
        if tok.chat_template:
            messages = [{"role": "user", "content": question}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out.append(tuple(tok(text, add_special_tokens=False)["input_ids"]))
        else:
            out.append(tuple(tok(question)["input_ids"]))
    return out


def requests(prompts: list[tuple[int, ...]], group: int, new: int, seed: int):
    out = []
    for p, ids in enumerate(prompts):
        for i in range(group):
            sampling = SamplingParams(
                max_new_tokens=new, temperature=1.0, seed=seed * 10_000 + p * 100 + i
            )
            out.append(GenerateRequest(input_ids=ids, sampling=sampling, rid=f"r{seed}-{p}-{i}"))
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


def start_vllm(
    model: Path, log: Path, args: argparse.Namespace
) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [
        "bash",
        str(ROOT / "scripts/serve_vllm.sh"),
        str(model),
        str(port),
        "--dtype",
        args.dtype,
    ]
    if args.cores:  # its whole process tree on the core, its worker's threads bound there
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, args.cores))
        command = ["taskset", "-c", ",".join(map(str, args.cores)), *command]
    elif args.vllm_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
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


def frozen(server: tuple[int, bool], stop: bool) -> None:
    """Stop or continue a server: (vLLM's process group, True) or (the built-in's pid, False)."""
    pid, group = server
    (os.killpg if group else os.kill)(pid, signal.SIGSTOP if stop else signal.SIGCONT)
    time.sleep(0.1 if stop else 0.5)


async def bench(args: argparse.Namespace, model: Path, vllm_url: str, vllm_pgid: int) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    threads = len(args.cores) if args.cores else os.cpu_count() or 1
    started = time.monotonic()
    kwargs = {"cpus": args.cores} if args.cores else {}
    async with engine_process(
        model, max_batch=128, torch_threads=threads, dtype=args.dtype, **kwargs
    ) as proc:
        print(f"built-in engine ready in {time.monotonic() - started:.1f}s")
        servers = {"builtin": (proc.process.pid, False), "vllm": (vllm_pgid, True)}
        builtin = SGLangEngine(proc.url, options=OPTIONS)
        real = VLLMEngine(vllm_url, options=OPTIONS)
        warm = requests(prompt_ids(tok, 2, seed=99), args.group, 8, seed=99)
        await builtin_batch(builtin, warm, args.group)
        await vllm_batch(real, warm)
        rate = await trio.to_thread.run_sync(matmul_rate, model, args, threads, servers)
        rounds: dict[str, list[float]] = {"builtin": [], "vllm": []}
        lengths: dict[str, list[float]] = {"builtin": [], "vllm": []}
        for r in range(args.rounds):
            reqs = requests(prompt_ids(tok, args.prompts, seed=r), args.group, args.new_tokens, r)
            for name in ("builtin", "vllm") if r % 2 == 0 else ("vllm", "builtin"):
                idle = servers["vllm" if name == "builtin" else "builtin"]
                frozen(idle, True)
                t = time.monotonic()
                if name == "builtin":
                    tokens = await builtin_batch(builtin, reqs, args.group)
                else:
                    tokens = await vllm_batch(real, reqs)
                took = time.monotonic() - t
                frozen(idle, False)
                rounds[name].append(tokens / took)
                lengths[name].append(tokens / len(reqs))
                print(
                    f"round {r} {name:8s} {took:7.2f}s {tokens:6d} tok {tokens / took:6.0f} tok/s"
                )
        await builtin.aclose()
        await real.aclose()
    report(rounds, lengths, rate, model, args)


def matmul_rate(model: Path, args: argparse.Namespace, threads: int, servers: dict) -> float:
    """The bare decode-shaped matmul rate on the engines' cores, both servers stopped."""
    for server in servers.values():
        frozen(server, True)
    try:
        shapes = shapes_of(AutoConfig.from_pretrained(model))
        with pinned(args.cores):
            return decode_rate(shapes, DECODE_ROWS, getattr(torch, args.dtype), threads)
    finally:
        for server in servers.values():
            frozen(server, False)


def report(rounds: dict, lengths: dict, rate: float, model: Path, args) -> None:
    flops = 2 * shapes_of(AutoConfig.from_pretrained(model)).params
    where = (
        f"core {args.cores[0]}"
        if len(args.cores) == 1
        else (f"cores {args.cores}" if args.cores else "the whole box")
    )
    print(f"{args.model}, {args.dtype}, {where}; bare matmul rate {rate / 1e9:.1f} GFLOP/s")
    for name, rates in rounds.items():
        med = statistics.median(rates)
        print(
            f"{name:8s} median {med:7.0f} tok/s, slowest round {min(rates):6.0f} "
            f"(median/slowest {med / min(rates):.2f}), "
            f"mean length {statistics.mean(lengths[name]):.1f}, "
            f"decode at {100 * med * flops / rate:.0f}% of the matmul rate"
        )
    b, v = statistics.median(rounds["builtin"]), statistics.median(rounds["vllm"])
    print(f"ratio built-in / vLLM (tok/s): {b / v:.2f} (above 1: the built-in engine is faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cores", default="1", help="a core list (e.g. 1), or 'all': unpinned")
    parser.add_argument("--vllm-bind", default="", help="whole box: VLLM_CPU_OMP_THREADS_BIND")
    args = parser.parse_args()
    args.cores = () if args.cores == "all" else tuple(int(c) for c in args.cores.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        log = ROOT / "runs" / f"bench_vllm-{args.model}.log"  # kept: vLLM says why it failed
        log.parent.mkdir(exist_ok=True)
        proc, url, ready_s = start_vllm(model, log, args)
        print(f"vLLM ({args.model}, {args.dtype}) ready in {ready_s:.1f}s")
        try:
            trio.run(bench, args, model, url, os.getpgid(proc.pid))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


if __name__ == "__main__":
    main()
