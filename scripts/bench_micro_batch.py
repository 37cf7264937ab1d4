"""Benchmark: one RL training step (forward/backward over the batch + AdamW) per micro-batch size.

The batch is the RL workload's shape (16 groups x 8 samples, 22 prompt + 30-64 response tokens,
GRPO advantages); one backend per size, all in this process, timed in interleaved rounds (the
first left out), so the sizes see the same machine. Prints the median seconds per step and the
ratio against the first size given (the baseline). On the demo's tiny model with one torch thread
this is what chose `micro_batch_tokens = 2048` in configs/demo-cpu.toml.

    python scripts/bench_micro_batch.py [--model DIR] [--rounds 6] 8192 4096 2048 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_rl_step import bench_config  # scripts/ is on sys.path when run

from rollouts.algorithms.batch import build_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.training.backends.factories import create_backend
from rollouts.training.engines import cpu_share
from rollouts.training.run_setup import prepare_base_model, prepare_data
from rollouts.types import Sample, Status


def rl_groups(
    vocab: int, seed: int = 0, prompt: int = 22, groups: int = 16
) -> list[tuple[Sample, ...]]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        group = []
        for _ in range(8):
            response = rng.randint(30, 64)
            tokens = tuple(rng.randrange(3, vocab) for _ in range(prompt + response))
            group.append(
                Sample(
                    index=g,
                    group_index=g,
                    prompt="x",
                    tokens=tokens,
                    response_length=response,
                    loss_mask=(0,) * prompt + (1,) * response,
                    rollout_logprobs=(-0.5,) * response,
                    reward=float(rng.random() > 0.5),
                    status=Status.COMPLETED,
                )
            )
        out.append(tuple(group))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", type=int, nargs="+", help="micro_batch_tokens; first = baseline")
    parser.add_argument("--model", default="", help="an HF model directory (default: tiny)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(cpu_share(0, "cpu", 1))
    with tempfile.TemporaryDirectory(prefix="bench-mb-") as tmp:
        config = bench_config(Path(tmp), "sync", 2, args.model, [])
        prepare_data(config)
        model_dir = prepare_base_model(config)
        backends = {}
        for size in args.sizes:
            training = dataclasses.replace(config.training, micro_batch_tokens=size)
            sized = dataclasses.replace(config, training=training)
            backends[size] = create_backend(sized, model_path=model_dir, total_steps=1000)
        vocab = backends[args.sizes[0]].lm.config.vocab_size
        batch = build_train_batch(rl_groups(min(vocab, 40)), config.algorithm)
        loss_fn = make_loss_fn(config.algorithm)
        times: dict[int, list[float]] = {size: [] for size in args.sizes}
        for r in range(args.rounds + 1):
            for size, backend in backends.items():
                started = time.perf_counter()
                backend.forward_backward(batch, loss_fn, entropy=True).result()
                backend.optim_step().result()
                if r:  # round 0 warms up
                    times[size].append(time.perf_counter() - started)
    base = statistics.median(times[args.sizes[0]])
    print(f"{'micro_batch_tokens':>18} {'median s/step':>14} {'vs ' + str(args.sizes[0]):>10}")
    for size in args.sizes:
        median = statistics.median(times[size])
        print(f"{size:>18} {median:>14.3f} {base / median:>9.2f}x")


if __name__ == "__main__":
    main()
