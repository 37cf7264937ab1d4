"""Benchmark: the built-in engine server vs in-process padded `model.generate`, same process.

128 concurrent requests, mixed prompt lengths, greedy with EOS ignored (so lengths are exact),
run twice: equal output lengths, then lengths varying 4-64 tokens. Prints tokens/s of the
baseline (one padded `generate` call of all prompts, run to the longest length; only the
requested tokens count) and of the server through each client, with the ratios.

    .venv/bin/python scripts/bench_engine.py [--requests 128] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
import trio
from transformers import AutoModelForCausalLM

from rollouts.inference.http import HttpOptions
from rollouts.inference.launch import engine_server
from rollouts.inference.protocol import SamplingParams
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model


def workload(n: int, seed: int, equal: int | None) -> tuple[list[list[int]], list[int]]:
    """Prompts of 8-64 random byte tokens and output lengths (equal, or uniform in 4..64)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 64))] for _ in range(n)]
    lengths = [equal if equal is not None else rng.randint(4, 64) for _ in range(n)]
    return prompts, lengths


@torch.inference_mode()
def baseline(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> float:
    """Tokens/s of one left-padded `generate` call over all prompts (useful tokens only)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(lengths)
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=pad_id,
    )
    return sum(lengths) / (time.perf_counter() - start)


async def through(client, prompts: list[list[int]], lengths: list[int]) -> float:
    """Tokens/s of all requests sent at once through `client`."""
    done: list[int] = []

    async def one(p: list[int], n: int) -> None:
        sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        done.append((await client.generate(p, sampling)).completion_tokens)

    await client.generate(prompts[0], SamplingParams(max_new_tokens=2, temperature=0.0))
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for p, n in zip(prompts, lengths, strict=True):
            nursery.start_soon(one, p, n)
    elapsed = time.perf_counter() - start
    assert sum(done) == sum(lengths), f"{sum(done)=} != {sum(lengths)=}"
    return sum(done) / elapsed


async def run_server_side(model_dir: str, cases: dict, args: argparse.Namespace) -> dict:
    options = HttpOptions(max_connections=args.connections, timeout_s=600)
    out: dict[tuple[str, str], float] = {}
    async with engine_server(model_dir, max_batch=args.requests, startup_timeout_s=300) as url:
        for name, (prompts, lengths) in cases.items():
            for client_cls in (SGLangEngine, VLLMEngine):
                client = client_cls(url, options=options)
                out[(name, client_cls.__name__)] = await through(client, prompts, lengths)
                await client.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--equal-len", type=int, default=32)
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = tempfile.mkdtemp(prefix="bench-engine-")
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=256,
        seed=args.seed,
    )
    make_tiny_model(model_dir, spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    cases = {
        "equal": workload(args.requests, args.seed, args.equal_len),
        "varying": workload(args.requests, args.seed + 1, None),
    }
    base = {name: baseline(model, p, n, 0) for name, (p, n) in cases.items()}
    served = trio.run(run_server_side, model_dir, cases, args)
    print(
        f"{args.requests} concurrent requests, hidden {args.hidden}, {args.layers} layers, "
        f"{torch.get_num_threads()} torch threads, {args.connections} connections per client"
    )
    print(
        f"{'case':<8} {'generate tok/s':>15} {'SGLang tok/s':>13} {'ratio':>6} "
        f"{'vLLM tok/s':>11} {'ratio':>6}"
    )
    for name in cases:
        s, v = served[(name, "SGLangEngine")], served[(name, "VLLMEngine")]
        print(
            f"{name:<8} {base[name]:>15.1f} {s:>13.1f} {s / base[name]:>6.2f} "
            f"{v:>11.1f} {v / base[name]:>6.2f}"
        )
    print("goals: equal >= 0.80x, varying >= 1.20x")


if __name__ == "__main__":
    main()
