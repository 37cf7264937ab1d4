"""Held-out accuracy of a model directory, greedy and sampled, through a built-in engine.

    python scripts/eval_model.py MODEL_DIR --data runs/smollm2-data/eval.jsonl \
        [--size 60] [--max-new-tokens 12] [--temperature 0.7] [--samples 4]

The same path as training's evaluation (`rollouts.driver.evaluation.evaluate`, the exact-match
verifier, the model's chat template); the sampled pass rolls each prompt out `--samples` times.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import trio

from rollouts.data.loaders import load_prompts
from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.engine.launch import engine_server
from rollouts.inference.sglang import SGLangEngine
from rollouts.rewards.verifiers import make_exact_match_reward, tokenizer_decoder
from rollouts.rollout.generate import generate_single_turn
from rollouts.trainer.factories import load_tokenizer


def sampled_at(temperature: float):
    """A generate function that samples at `temperature` (evaluation itself asks for 0)."""

    async def generate(sample, ctx):
        sampling = dataclasses.replace(ctx.sampling, temperature=temperature)
        return await generate_single_turn(sample, dataclasses.replace(ctx, sampling=sampling))

    return generate


async def main(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(Path(args.model))
    items = load_prompts(args.data, "prompt", "label", "messages")[: args.size or None]
    reward = make_exact_match_reward(tokenizer_decoder(tokenizer))
    async with engine_server(args.model, max_batch=256) as url:
        engine = SGLangEngine(url)
        greedy = await evaluate(
            engine, tokenizer, items, reward, EvalSpec(max_new_tokens=args.max_new_tokens)
        )
        spec = EvalSpec(
            max_new_tokens=args.max_new_tokens, generate_fn=sampled_at(args.temperature)
        )
        repeated = [  # distinct indices: they name the requests
            dataclasses.replace(item, index=k * len(items) + item.index)
            for k in range(args.samples)
            for item in items
        ]
        sampled = await evaluate(engine, tokenizer, repeated, reward, spec)
        await engine.aclose()
    print(f"model {args.model}")
    print(f"greedy accuracy: {greedy.accuracy:.3f} ({len(items)} held-out prompts)")
    print(
        f"sampled accuracy at T={args.temperature}: {sampled.accuracy:.3f} "
        f"({len(items)} x {args.samples}); mean length {sampled.response_length_mean:.1f} tokens"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--data", required=True)
    parser.add_argument("--size", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--samples", type=int, default=4)
    trio.run(main, parser.parse_args())
