"""Benchmark: one RL training step (forward/backward over the batch + AdamW) per micro-batch size.

The batch is the RL workload's shape (16 groups x 8 samples, 22 prompt + 30-64 response tokens,
GRPO advantages); one backend per size, all in this process, timed in interleaved rounds (the
first left out), so the sizes see the same machine. Prints the median seconds per step and the
ratio against the first size given (the baseline). On the demo's tiny model with one torch thread
this is what chose `micro_batch_tokens = 2048` in configs/demo-cpu.toml.

    python scripts/bench_micro_batch.py [--model DIR] [--rounds 6] [--autocast bfloat16]
        [--layout prefix] 8192 4096 2048 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_rl_step import bench_config  # scripts/ is on sys.path when run

from rollouts.algorithms.batch import build_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import Config
from rollouts.driver.engines import cpu_share
from rollouts.driver.setup import prepare_base_model, prepare_data
from rollouts.trainer.factories import create_backend
from rollouts.types import LossFn, Sample, Status, TrainBatch


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


def bench_model(work: Path, model: str) -> tuple[Config, Path]:
    """The bench config (the demo's, sync) with its data and model directory ready."""
    config = bench_config(work, "sync", 2, model, [])
    prepare_data(config)
    return config, prepare_base_model(config)


def variant_backends(config: Config, model_dir: Path, variants: dict[Any, dict]) -> dict:
    """One backend per variant: `[training]` with that variant's fields replaced."""
    backends = {}
    for key, fields in variants.items():
        training = dataclasses.replace(config.training, **fields)
        changed = dataclasses.replace(config, training=training)
        backends[key] = create_backend(changed, model_path=model_dir, total_steps=1000)
    return backends


def interleaved_steps(
    backends: dict, batch: TrainBatch, loss_fn: LossFn, rounds: int
) -> tuple[dict[Any, list[float]], dict[Any, float]]:
    """Seconds per RL training step (forward/backward + AdamW) of each backend, the backends
    taking turns round by round (round 0 warms up, left out); and each one's first loss."""
    times: dict[Any, list[float]] = {key: [] for key in backends}
    first_loss: dict[Any, float] = {}
    for r in range(rounds + 1):
        for key, backend in backends.items():
            started = time.perf_counter()
            metrics = backend.forward_backward(batch, loss_fn, entropy=True).result()
            backend.optim_step().result()
            if r:
                times[key].append(time.perf_counter() - started)
            else:
                first_loss[key] = float(metrics["loss"])
    return times, first_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", type=int, nargs="+", help="micro_batch_tokens; first = baseline")
    parser.add_argument("--model", default="", help="an HF model directory (default: tiny)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--autocast", choices=("off", "bfloat16"), default="off")
    parser.add_argument("--layout", choices=("pad", "prefix"), default="pad")
    args = parser.parse_args()
    torch.set_num_threads(cpu_share(0, "cpu", 1))
    with tempfile.TemporaryDirectory(prefix="bench-mb-") as tmp:
        config, model_dir = bench_model(Path(tmp), args.model)
        fixed = {"autocast": args.autocast, "micro_batch_layout": args.layout}
        variants = {size: {"micro_batch_tokens": size, **fixed} for size in args.sizes}
        backends = variant_backends(config, model_dir, variants)
        vocab = backends[args.sizes[0]].lm.config.vocab_size
        batch = build_train_batch(rl_groups(min(vocab, 40)), config.algorithm)
        times, _ = interleaved_steps(backends, batch, make_loss_fn(config.algorithm), args.rounds)
    base = statistics.median(times[args.sizes[0]])
    print(f"{'micro_batch_tokens':>18} {'median s/step':>14} {'vs ' + str(args.sizes[0]):>10}")
    for size in args.sizes:
        median = statistics.median(times[size])
        print(f"{size:>18} {median:>14.3f} {base / median:>9.2f}x")


if __name__ == "__main__":
    main()
