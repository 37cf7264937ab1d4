"""Benchmark: one RL training step (forward/backward over the batch + AdamW) per micro-batch size.

The batch is the RL workload's shape (16 groups x 8 samples, 22 prompt + 30-64 response tokens,
GRPO advantages); one backend per size, all in this process, timed in interleaved rounds (the
first left out), so the sizes see the same machine. Prints the median seconds per step and the
ratio against the first size given (the baseline). On the demo's tiny model with one torch thread
this is what chose `micro_batch_tokens = 2048` in configs/demo-cpu.toml.

`--cut COST ...` times one size under each `batching.MICRO_BATCH_COST_SLOTS` instead (what
`cut_rows` charges a micro-batch, in token slots; the first the baseline: a huge one cuts into
the fewest micro-batches, as a greedy cut at the budget did), on an agent-shaped batch (2 groups
x 16 of a 280-token prompt, rests of 32-60 tokens and a quarter of 90-140) with one backend.

    python scripts/bench_micro_batch.py [--model DIR] [--rounds 6] [--autocast bfloat16]
        [--layout prefix] [--threads 2] [--set KEY=VALUE ...] [--cut 1000000 64 256 512]
        8192 4096 2048 1024
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
from rollouts.trainer import batching
from rollouts.trainer.factories import create_backend
from rollouts.types import LossFn, Sample, Status, TrainBatch


def rl_sample(group: int, tokens: tuple[int, ...], prompt: int, rng: random.Random) -> Sample:
    """A completed sample of group `group`: `prompt` untrained tokens, the rest its response."""
    response = len(tokens) - prompt
    return Sample(
        index=group,
        group_index=group,
        prompt="x",
        tokens=tokens,
        response_length=response,
        loss_mask=(0,) * prompt + (1,) * response,
        rollout_logprobs=(-0.5,) * response,
        reward=float(rng.random() > 0.5),
        status=Status.COMPLETED,
    )


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
            group.append(rl_sample(g, tokens, prompt, rng))
        out.append(tuple(group))
    return out


def agent_groups(vocab: int, seed: int = 0, prompt: int = 280) -> list[tuple[Sample, ...]]:
    """Two groups of 16 as the shop agent's (configs/smollm2-agent-cpu.toml): a long shared prompt
    (the tools' description), most episodes short and a quarter long."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        head = tuple(rng.randrange(3, vocab) for _ in range(prompt))
        group = []
        for _ in range(16):
            response = rng.randint(90, 140) if rng.random() < 0.25 else rng.randint(32, 60)
            tokens = head + tuple(rng.randrange(3, vocab) for _ in range(response))
            group.append(rl_sample(g, tokens, prompt, rng))
        out.append(tuple(group))
    return out


def bench_model(work: Path, model: str, overrides: list[str] = ()) -> tuple[Config, Path]:
    """The bench config (the demo's, sync) with its data and model directory ready."""
    config = bench_config(work, "sync", 2, model, list(overrides))
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


def cut_costs(
    backend: Any, batch: TrainBatch, loss_fn: LossFn, costs: list[int], rounds: int
) -> dict[int, list[float]]:
    """Seconds of forward/backward of one backend under each MICRO_BATCH_COST_SLOTS, the costs
    taking turns round by round (round 0 warms up, left out; the optimizer steps untimed)."""
    times: dict[int, list[float]] = {cost: [] for cost in costs}
    for r in range(rounds + 1):
        for cost in costs:
            batching.MICRO_BATCH_COST_SLOTS = cost
            started = time.perf_counter()
            backend.forward_backward(batch, loss_fn, entropy=True).result()
            if r:
                times[cost].append(time.perf_counter() - started)
            backend.optim_step().result()
    return times


def cut_plans(batch: TrainBatch, budget: int, cost: int) -> tuple[int, int]:
    """(micro-batches, token slots) of the prefix layout's plan of `batch` at `cost`."""
    from rollouts.trainer.prefix_plan import plan_shared_prefixes

    batching.MICRO_BATCH_COST_SLOTS = cost
    plans = plan_shared_prefixes(batch.input_ids, batch.loss_mask, budget)
    return len(plans), sum(plan.padded_tokens for plan in plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", type=int, nargs="+", help="micro_batch_tokens; first = baseline")
    parser.add_argument("--model", default="", help="an HF model directory (default: tiny)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--autocast", choices=("off", "bfloat16"), default="off")
    parser.add_argument("--layout", choices=("pad", "prefix"), default="pad")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: a share)")
    parser.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE")
    parser.add_argument("--cut", type=int, nargs="+", default=[], help="MICRO_BATCH_COST_SLOTS")
    args = parser.parse_args()
    torch.set_num_threads(cpu_share(0, "cpu", args.threads))
    if args.cut:
        assert len(args.sizes) == 1, f"--cut times one micro_batch_tokens, not {args.sizes}"
        return main_cut(args)
    with tempfile.TemporaryDirectory(prefix="bench-mb-") as tmp:
        config, model_dir = bench_model(Path(tmp), args.model, args.set)
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


def main_cut(args: argparse.Namespace) -> None:
    (size,) = args.sizes
    with tempfile.TemporaryDirectory(prefix="bench-mb-") as tmp:
        config, model_dir = bench_model(Path(tmp), args.model, args.set)
        fields = {"micro_batch_tokens": size, "autocast": args.autocast}
        fields["micro_batch_layout"] = "prefix"
        (backend,) = variant_backends(config, model_dir, {size: fields}).values()
        vocab = backend.lm.config.vocab_size
        batch = build_train_batch(agent_groups(min(vocab, 40)), config.algorithm)
        plans = {cost: cut_plans(batch, size, cost) for cost in args.cut}
        times = cut_costs(backend, batch, make_loss_fn(config.algorithm), args.cut, args.rounds)
    base = statistics.median(times[args.cut[0]])
    head = f"{'cost (slots)':>12} {'micro-batches':>13} {'slots':>6} {'median s':>9}"
    print(f"{head} {'vs first':>9}")
    for cost in args.cut:
        median = statistics.median(times[cost])
        count, slots = plans[cost]
        print(f"{cost:>12} {count:>13} {slots:>6} {median:>9.3f} {base / median:>8.2f}x")


if __name__ == "__main__":
    main()
