"""Benchmark: AsyncRolloutManager vs calling the engine directly with the same requests.

Starts one built-in engine server on a tiny model, then in the same process measures
  1. direct: batch_size * n requests sent straight to the engine (same concurrency bound),
  2. manager, no over-sampling and no filter (the manager's own overhead),
  3. manager with over-sampling and a dynamic filter (the realistic case),
and prints samples/s, ratios to the direct baseline, and the fraction of engine time spent on
samples that were thrown away (filtered, surplus, or aborted without partial reuse).

    python scripts/bench_rollout.py [--batches 3] [--batch-size 8] [--n 4] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio
from transformers import AutoTokenizer

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.data.buffer import DataBuffer
from rollouts.data.sft import tokenize_prompt
from rollouts.engine.launch import engine_server_sync
from rollouts.inference.sglang import SGLangEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.rollout.generate import sampling_params_from_config
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import PromptItem, Sample


def parity_reward(sample: Sample) -> float:
    """Reward 1 when the first response token is even: some groups vary, some do not."""
    return float(sample.response_tokens[:1] and sample.response_tokens[0] % 2 == 0)


def prompts(num: int) -> list[PromptItem]:
    return [PromptItem(index=i, prompt=f"What is {i} + {i + 1}?") for i in range(num)]


async def direct(engine: SGLangEngine, tok, config: RolloutConfig, batches: int) -> float:
    """Samples/s sending batch_size * n requests per batch straight to the engine."""
    params = sampling_params_from_config(config)
    items = prompts(config.batch_size * batches)
    limiter = trio.CapacityLimiter(config.max_concurrency)

    async def one(ids: list[int]) -> None:
        async with limiter:
            await engine.generate(ids, params)

    start = time.perf_counter()
    for b in range(batches):
        async with trio.open_nursery() as nursery:
            for item in items[b * config.batch_size : (b + 1) * config.batch_size]:
                ids = tokenize_prompt(tok, item.prompt)
                for _ in range(config.n_samples_per_prompt):
                    nursery.start_soon(one, ids)
    return batches * config.batch_size * config.n_samples_per_prompt / (time.perf_counter() - start)


async def managed(engine, tok, config: RolloutConfig, batches: int) -> dict[str, float]:
    """Kept samples/s through the manager, and its discarded engine-time fraction."""
    buffer = DataBuffer(prompts(config.batch_size * batches * 8), shuffle=False)
    manager = AsyncRolloutManager(buffer, config, engine, tokenizer=tok, reward_fn=parity_reward)
    kept = gen_time = discarded = aborted = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        batch = await manager.generate_batch()
        kept += len(batch.samples)
        gen_time += batch.metadata["gen_time_s"]
        discarded += batch.metadata["discarded_gen_time_s"]
        aborted += batch.metadata.get("aborted_samples", 0)
    elapsed = time.perf_counter() - start
    return {
        "samples_per_s": kept / elapsed,
        "discarded": discarded / max(gen_time, 1e-9),
        "aborted": aborted,
    }


async def main(args: argparse.Namespace, url: str, tok) -> None:
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    base = RolloutConfig(
        batch_size=args.batch_size,
        n_samples_per_prompt=args.n,
        over_sampling_factor=1.0,
        max_concurrency=args.concurrency,
        sampling=sampling,
    )
    filtered = RolloutConfig(
        batch_size=args.batch_size,
        n_samples_per_prompt=args.n,
        over_sampling_factor=1.5,
        max_concurrency=args.concurrency,
        max_over_sampling_rounds=8,
        filters=["check_reward_nonzero_std"],
        sampling=sampling,
    )
    engine = SGLangEngine(url)
    try:
        await direct(engine, tok, base, 1)  # warm-up
        rate_direct = await direct(engine, tok, base, args.batches)
        plain = await managed(engine, tok, base, args.batches)
        over = await managed(engine, tok, filtered, args.batches)
        rate_direct = (rate_direct + await direct(engine, tok, base, args.batches)) / 2
    finally:
        await engine.aclose()
    print(
        f"batches={args.batches} batch_size={args.batch_size} n={args.n} "
        f"max_new_tokens={args.max_new_tokens} concurrency={args.concurrency}"
    )
    print(
        f"direct engine calls          : {rate_direct:8.2f} samples/s "
        "(baseline: mean of runs before/after)"
    )
    print(
        f"manager, no over-sampling    : {plain['samples_per_s']:8.2f} samples/s "
        f"({plain['samples_per_s'] / rate_direct:.2f}x direct), discarded engine time "
        f"{plain['discarded']:.1%}"
    )
    print(
        f"manager, x1.5 + std filter   : {over['samples_per_s']:8.2f} kept samples/s "
        f"({over['samples_per_s'] / rate_direct:.2f}x direct), discarded engine time "
        f"{over['discarded']:.1%}, aborted samples {over['aborted']:.0f}"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default="", help="HF model dir (default: build a tiny one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = (
            Path(args.model)
            if args.model
            else make_tiny_model(
                Path(tmp) / "tiny", TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4)
            )
        )
        tok = AutoTokenizer.from_pretrained(model)
        with engine_server_sync(model, max_batch=64) as proc:
            trio.run(main, args, proc.url, tok)


if __name__ == "__main__":
    cli()
