"""Benchmark: what `logging.save_batches` costs a step.

Two measures:
- synthetic: `write_batch` (the loop's save, without the thread hop) of batches of SAMPLES
  samples of TOKENS tokens each (half prompt, half response; engine logprobs, advantages and
  old logprobs as a PPO step stores them), median of `--rounds`; seconds, MB and tokens/s;
- `--run RUN_DIR`: a real run's metrics.jsonl: the median `time/save_batch_s` against the
  median `perf/step_time_s` of its steps (the save is part of the step's time).

    .venv/bin/python scripts/bench_save_batches.py [--sizes 32x128,512x1024] [--rounds 5]
    .venv/bin/python scripts/bench_save_batches.py --run runs/demo-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollouts.loop.batch_files import StoredBatch, step_dir, write_batch
from rollouts.types import Sample, Status, TrainBatch


def synthetic(samples: int, tokens: int, group: int = 8) -> StoredBatch:
    """A batch of `samples` samples of `tokens` tokens (groups of `group`), PPO's fields."""
    half = tokens // 2
    made = [
        Sample(
            index=i // group,
            group_index=i // group,
            prompt="x" * 200,
            label="42",
            tokens=tuple(range(i, i + tokens)),
            loss_mask=(0,) * (tokens - half) + (1,) * half,
            response_length=half,
            rollout_logprobs=tuple(-0.001 * k for k in range(half)),
            reward=1.0,
            status=Status.COMPLETED,
            weight_versions=("3",),
        )
        for i in range(samples)
    ]
    per_token = tuple(torch.randn(tokens) for _ in made)
    trained = TrainBatch(
        input_ids=tuple(torch.tensor(s.tokens) for s in made),
        loss_mask=tuple(torch.tensor(s.loss_mask, dtype=torch.float32) for s in made),
        advantages=per_token,
        old_logprobs=per_token,
        num_global_tokens=float(samples * half),
        num_global_seqs=float(samples),
    )
    groups = tuple(tuple(made[g : g + group]) for g in range(0, samples, group))
    return StoredBatch(
        step=1, number=1, version=0, groups=groups, metadata={}, shape={}, trained=trained
    )


def bench_synthetic(sizes: list[tuple[int, int]], rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for samples, tokens in sizes:
            batch = synthetic(samples, tokens)
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                write_batch(root, batch)
                times.append(time.perf_counter() - started)
            size = sum(p.stat().st_size for p in step_dir(root, 1).iterdir()) / 1e6
            median = statistics.median(times)
            rate = samples * tokens / median
            print(
                f"{samples} x {tokens} tokens: {median * 1e3:.1f} ms a save (median of {rounds}), "
                f"{size:.1f} MB, {rate / 1e6:.2f} M tokens/s"
            )


def bench_run(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/save_batch_s" in r]
    if not steps:
        raise SystemExit(f"{run}/metrics.jsonl has no time/save_batch_s: logging.save_batches off")
    save = statistics.median(r["time/save_batch_s"] for r in steps)
    step = statistics.median(r["perf/step_time_s"] for r in steps)
    print(
        f"{run}: {len(steps)} steps; save {save * 1e3:.1f} ms, step {step:.3f} s "
        f"(medians): the save is {save / step:.2%} of a step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128x64,32x256,512x1024", help="SAMPLESxTOKENS,...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run", type=Path, default=None, help="a run dir with save_batches on")
    args = parser.parse_args()
    if args.run is not None:
        bench_run(args.run)
        return
    sizes = [tuple(int(n) for n in s.split("x")) for s in args.sizes.split(",")]
    bench_synthetic([(a, b) for a, b in sizes], args.rounds)


if __name__ == "__main__":
    main()
