"""Benchmark: the built-in engine's numerics on SmolLM2, the RL rollout shape, in one process.

Loads the model as `rollouts serve` does for each variant (bf16 weights; fp32 weights under bf16
autocast, `--autocast bfloat16`, with eager attention as the SmolLM2 configs train; fp32
weights), then times whole rounds of the engine's running batch (`RunningBatch`, no HTTP: 10
prompts x 8 seeded samples, 12 new tokens, as `configs/smollm2-lora-cpu.toml` generates a step),
rounds interleaved, and prints each variant's median round and its ratio to the bf16 engine's.

    python scripts/bench_precision.py [--model DIR] [--rounds 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampling import one_round

from rollouts.config.engine_options import EngineOptions
from rollouts.engine.app import load_model

VARIANTS = {
    "bf16 weights": {"dtype": "bfloat16"},
    "fp32 under bf16 autocast": {"autocast": "bfloat16", "attn_implementation": "eager"},
    "fp32": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_model = Path.home() / ".cache/rollouts/models/smollm2-135m-instruct"
    parser.add_argument("--model", default=str(default_model))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = {
        name: load_model(EngineOptions(model=args.model, **kwargs))
        for name, kwargs in VARIANTS.items()
    }
    tok = next(iter(loaded.values()))[1]
    prompts = []
    for i in range(args.prompts):
        chat = [{"role": "user", "content": f"What is {3 + 7 * i % 27} + {11 + 5 * i % 19}?"}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    times: dict[str, list[float]] = {name: [] for name in loaded}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (model, _) in loaded.items():
            start = time.perf_counter()
            one_round(model, tok, prompts, args.samples, args.new, seeded=True)
            if r:
                times[name].append(time.perf_counter() - start)
    print(
        f"{Path(args.model).name}: rounds of {args.prompts} prompts x {args.samples} seeded "
        f"samples, {args.new} new tokens, {args.threads} thread(s); medians of {args.rounds}"
    )
    base = statistics.median(times["bf16 weights"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:26s} {median:6.3f} s a round  {median / base:5.2f}x the bf16 engine's time")


if __name__ == "__main__":
    main()
