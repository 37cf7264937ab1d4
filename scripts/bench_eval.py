"""Benchmark: held-out evaluation with batch requests vs one request per prompt, same process.

The demo's evaluation (configs/demo-cpu.toml: its eval set, greedy, max_new_tokens, the exact-
match reward) against one built-in engine on the demo's tiny model: `evaluate` as runs use it
(prompts EVAL_BATCH at a time as one request each) and with one request per prompt (the generate
function passed explicitly, which is what any custom or multi-turn generation gets). Each rep
runs both, in alternating order; the ratio is per rep (the machine's load drifts). The accuracy
must be the same both ways (greedy answers do not depend on the batch).

    .venv/bin/python scripts/bench_eval.py [--reps 3] [--items 200] [--model DIR]
(default: the demo's untrained base model; a demo checkpoint's `model/` gives a real accuracy)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import trio

from rollouts.config import load_config
from rollouts.data.loaders import load_prompts
from rollouts.driver.evaluation import EVAL_BATCH, EvalSpec, evaluate
from rollouts.driver.setup import prepare_base_model, prepare_data, with_response_text
from rollouts.engine.launch import engine_process
from rollouts.inference.sglang import SGLangEngine
from rollouts.rewards.named import load_reward_fn
from rollouts.rollout.generate import generate_single_turn
from rollouts.trainer.factories import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


async def run(args: argparse.Namespace) -> None:
    config = load_config(ROOT / "configs" / "demo-cpu.toml", [])
    prepare_data(config)
    model_dir = Path(args.model) if args.model else prepare_base_model(config)
    tokenizer = load_tokenizer(model_dir)
    items = load_prompts(config.data.eval_path)[: args.items]
    reward = with_response_text(load_reward_fn(config.rollout.reward_fn), tokenizer)
    batched = EvalSpec(max_new_tokens=config.rollout.sampling.max_new_tokens)
    single = dataclasses.replace(batched, generate_fn=generate_single_turn)
    ratios = []
    async with engine_process(model_dir, max_batch=config.engines.builtin.max_batch) as proc:
        engine = SGLangEngine(proc.url)
        await evaluate(engine, tokenizer, items[:16], reward, batched)  # warm-up
        for rep in range(args.reps):
            times, accuracy = {}, {}
            for name in ("batched", "single") if rep % 2 == 0 else ("single", "batched"):
                spec = batched if name == "batched" else single
                started = time.perf_counter()
                result = await evaluate(engine, tokenizer, items, reward, spec)
                times[name] = time.perf_counter() - started
                accuracy[name] = result.accuracy
            assert accuracy["batched"] == accuracy["single"], accuracy
            ratios.append(times["single"] / times["batched"])
            print(
                f"rep {rep + 1}: {len(items)} prompts, batches of {EVAL_BATCH} "
                f"{times['batched']:.2f} s, one per prompt {times['single']:.2f} s, "
                f"ratio {ratios[-1]:.2f}x (accuracy {accuracy['batched']:.3f} both)",
                flush=True,
            )
        await engine.aclose()
    print(f"median speed-up of batched evaluation: {statistics.median(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--model", default="", help="e.g. a demo run's checkpoint model/ dir")
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
