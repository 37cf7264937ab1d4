"""Benchmark: an RL step of `rollouts` (sync and async) against the floor, in one process.

The workload of issue 11: 16 prompts x 8 samples (128 completions), up to 64 new tokens,
temperature 1, GRPO, no reference model, one optimizer step per batch, on the demo's tiny model
(or `--model DIR`, an HF model directory). Per round it runs, in this process:
  floor  the same batch generated with in-process padded `model.generate` plus one plain torch
         forward/backward/AdamW step (`bench_rl_floor.py`);
  sync   the project's RL phase with rollout.mode = "sync" (engine processes, weight sync, ...);
  async  the same with rollout.mode = "async" (by default training in its own process,
         `training.trainer_process = "auto"`);
  async-1p  (only with --modes ...,async-1p) async with the trainer in the driver's process,
         to show what the trainer process gains.
  sync-split  (only with --modes ...,sync-split) sync with the cores split between the trainer
         and the engine, as async mode does; sync colocates by default (each phase gets every
         core), and the ratio shows what that gains.
and prints seconds per step (the median of the timed steps, so a step slowed by the machine's
other load does not move it), samples/s, the phases (medians too), and the ratios
floor / sync step (target >= 0.9 on the tiny model) and async / sync samples/s (target >= 1.6).
With --compile the project trains with `model.compile = true` and the floor's training step runs
the same torch.compile'd decoder layers (the first, compiling, steps are among the skipped ones).
Torch threads are the driver's default share (cores // (engines + 1)), also for the floor.
Async overlaps generation with training, so it cannot beat sync by more than
sync step / max(generate, the rest): the "async ceiling" line. Every ratio needs a quiet machine
(two free cores for async); on a loaded one the processes wait for CPU and the GIL.

    python scripts/bench_rl_step.py [--model DIR] [--steps 12] [--skip 2] [--rounds 1] [--compile]
                                    [--modes floor,sync,async,async-1p]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio
from bench_rl_floor import FloorSpec, run_floor  # scripts/ is on sys.path when run

from rollouts.config import Config, load_config
from rollouts.data.loaders import load_prompts
from rollouts.data.sft import tokenize_prompt
from rollouts.driver.engines import cpu_share
from rollouts.driver.rl_phase import rl_phase
from rollouts.driver.setup import (
    StopFlag,
    prepare_base_model,
    prepare_data,
    prepare_run_dir,
)
from rollouts.trainer.factories import load_tokenizer

PHASES = ("generate", "logprobs", "train", "sync", "idle")
WORKLOAD = [
    "rollout.batch_size=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.over_sampling_factor=1.0",
    "rollout.max_concurrency=128",
    "engines.builtin.max_batch=128",
    "rollout.sampling.max_new_tokens=64",
    "rollout.sampling.temperature=1.0",
    "algorithm.advantage='grpo'",
    "algorithm.kl.coef=0.0",
]


MODES = ("floor", "sync", "async", "async-1p", "sync-split")
# async-1p: async with the trainer in the driver's process (the default trains in a child);
# sync-split: sync with the cores split as in async mode (the default colocates: every core for
# each phase)
MODE_OVERRIDES = {
    "async-1p": ["training.trainer_process='off'"],
    "sync-split": ["training.cpu_placement='split'"],
}
RL_MODE = {"floor": "sync", "async-1p": "async", "sync-split": "sync"}


def bench_config(work: Path, mode: str, steps: int, model: str, overrides: list[str]) -> Config:
    """The demo config with the issue's workload, no evaluation and no periodic checkpoints."""
    model_keys = [f"model.path='{model}'", "model.tiny.enabled=false"] if model else []
    return load_config(
        Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.toml",
        [
            f"run.output_dir='{work / mode}'",
            f"model.path='{work / 'model'}'",
            f"training.rl_steps={steps}",
            f"rollout.mode='{mode}'",
            "training.eval_every=0",
            "checkpoint.every=0",
            "logging.console=false",
            "data.eval_size=8",
            *WORKLOAD,
            *model_keys,
            *overrides,
        ],
    )


def run_mode(config: Config) -> list[dict]:
    """The project's RL phase; its metrics rows (one per step, step 0 = eval left out)."""
    run_dir = prepare_run_dir(config, "bench", resume=False)
    model = prepare_base_model(config)
    started = time.monotonic()
    trio.run(rl_phase, config, run_dir, model, False, StopFlag())
    print(f"[{config.rollout.mode}] done in {time.monotonic() - started:.1f}s", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 1]


def summarise(rows: list[dict], skip: int) -> dict[str, float]:
    """Median s/step, samples/s and phases over steps skip+1 .. last-1 (the last one evaluates
    and checkpoints)."""
    rows = rows[skip:-1]
    assert rows, "no timed step: raise --steps above --skip + 1"
    step_s = statistics.median(r["perf/step_time_s"] for r in rows)
    samples = statistics.median(r["perf/samples_per_s"] * r["perf/step_time_s"] for r in rows)
    out = {"step_s": step_s, "samples_per_s": samples / step_s}
    out["len"] = statistics.fmean(r["rollout/response_length_mean"] for r in rows)
    for phase in PHASES:
        out[phase] = statistics.median(r.get(f"time/{phase}_s", 0.0) for r in rows)
    out["generate_overlapped"] = statistics.median(
        r.get("time/generate_overlapped_s", 0.0) for r in rows
    )
    return out


def floor(config: Config, steps: int, skip: int) -> dict[str, float]:
    """The floor on the same model, prompts and settings, summarised like `summarise`."""
    model_dir = prepare_base_model(config)
    tokenizer = load_tokenizer(model_dir)
    items = load_prompts(config.data.train_path)[: config.rollout.batch_size]
    spec = FloorSpec(
        prompts=tuple(tuple(tokenize_prompt(tokenizer, it.prompt)) for it in items),
        n_samples=config.rollout.n_samples_per_prompt,
        max_new_tokens=config.rollout.sampling.max_new_tokens,
        temperature=config.rollout.sampling.temperature,
        lr=config.optim.lr,
        max_grad_norm=config.optim.max_grad_norm,
        micro_batch_tokens=config.training.micro_batch_tokens,
    )
    timed = run_floor(model_dir, spec, steps, compile_train=config.model.compile)[skip:-1]
    assert timed, "no timed floor step: raise --steps above --skip + 1"
    step_s = statistics.median(s.step_s for s in timed)
    return {
        "step_s": step_s,
        "samples_per_s": statistics.median(s.samples for s in timed) / step_s,
        "len": statistics.fmean(s.generated_tokens / s.samples for s in timed),
        "generate": statistics.median(s.generate_s for s in timed),
        "train": statistics.median(s.train_s for s in timed),
    }


def one_round(work: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    for mode in args.modes:
        rl_mode = RL_MODE.get(mode, mode)
        overrides = [*args.overrides, *MODE_OVERRIDES.get(mode, [])]
        config = bench_config(work, rl_mode, args.steps, args.model, overrides)
        if mode == "floor":
            prepare_data(config)
            out[mode] = floor(config, args.steps, args.skip)
        else:
            out[mode] = summarise(run_mode(config), args.skip)
        print(f"[{mode}] {out[mode]['step_s']:.3f} s/step", flush=True)
    return out


def report(results: dict[str, dict[str, float]]) -> tuple[float, float]:
    """Print one round's table and ratios; (floor / sync step, async / sync samples/s)."""
    keys = ("step_s", "samples_per_s", "len", *PHASES, "generate_overlapped")
    print(f"\n{'s/step':<20}" + "".join(f"{m:>10}" for m in results))
    for key in keys:
        cells = "".join(f"{results[m].get(key, float('nan')):>10.3f}" for m in results)
        print(f"{key:<20}{cells}")
    floor_ratio = results["floor"]["step_s"] / results["sync"]["step_s"]
    async_ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"floor / sync step: {floor_ratio:.2f} (target >= 0.9)")
    print(f"async / sync samples/s: {async_ratio:.2f}x (target >= 1.6)")
    if "async-1p" in results:
        one = results["async-1p"]["samples_per_s"] / results["sync"]["samples_per_s"]
        gain = results["async"]["samples_per_s"] / results["async-1p"]["samples_per_s"]
        print(f"async-1p (trainer in the driver's process) / sync samples/s: {one:.2f}x")
        print(f"async / async-1p samples/s (the trainer process's gain): {gain:.2f}x")
    if "sync-split" in results:
        split = results["sync"]["samples_per_s"] / results["sync-split"]["samples_per_s"]
        print(f"sync colocated / sync split samples/s (every core per phase): {split:.2f}x")
    sync = results["sync"]
    ceiling = sync["step_s"] / max(sync["generate"], sync["step_s"] - sync["generate"], 1e-9)
    print(f"async ceiling from the sync phases (step / slower stage): {ceiling:.2f}x")
    return floor_ratio, async_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="an HF model directory (default: tiny)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=1, help="floor/sync/async repetitions")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="model.compile = true for sync and async, and compiled layers in the floor's train",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--modes",
        default="floor,sync,async",
        help=f"comma-separated, in run order, from {','.join(MODES)} (async-1p: async with "
        "training.trainer_process = 'off'); floor, sync and async are required",
    )
    args = parser.parse_args()
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not {"floor", "sync", "async"} <= set(args.modes):
        parser.error(
            f"--modes {','.join(args.modes)}: give floor, sync, async (+ async-1p, sync-split)"
        )
    if args.compile:
        args.overrides = ["model.compile=true", *args.overrides]
    threads = cpu_share(0, "cpu", 1)
    torch.set_num_threads(threads)
    print(
        f"torch threads {threads} (trainer and floor); model {args.model or 'tiny (demo)'}; "
        f"decoder layers {'compiled' if args.compile else 'eager'} in training"
    )
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        for r in range(args.rounds):
            print(f"\n== round {r + 1}/{args.rounds}", flush=True)
            ratios.append(report(one_round(Path(tmp), args)))
    if args.rounds > 1:
        print(
            f"\nmedian over {args.rounds} rounds: floor / sync "
            f"{statistics.median(f for f, _ in ratios):.2f}, async / sync "
            f"{statistics.median(a for _, a in ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
