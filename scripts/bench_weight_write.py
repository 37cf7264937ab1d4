"""Benchmark: publishing a weight sync's files, against the `save_pretrained` way of before.

In one trainer process (SmolLM2-135M by default, full fine-tuning, bf16 autocast as
configs/smollm2-cpu.toml trains it, two RL steps first so the optimizer state is there), rounds
alternate two ways of publishing version k under /dev/shm, the two newest versions kept as a run
keeps them (each way in its own directory):
  save_pretrained  before: a CPU copy of the state dict, the tied head cloned, `save_pretrained`
                   (safetensors builds the whole file in memory, then writes it) and the
                   tokenizer into a new directory, renamed to v_k; the oldest version removed;
  publish          `files.publish_weights` now: the version it would remove renamed and its files
                   rewritten in place, tensor by tensor from the live parameters
                   (`write_engine_files`).
Both must hold the same tensors. Prints each way's median seconds, the process's user and system
CPU seconds per publish, and save_pretrained / publish.

    .venv/bin/python scripts/bench_weight_write.py [--model smollm2|tiny] [--rounds 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import SHAPES, model_dir, rl_batch

from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import (
    AlgorithmConfig,
    Config,
    ModelConfig,
    OptimConfig,
    TrainingConfig,
)
from rollouts.engine.weights import read_safetensors_dir
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.pytorch import engine_state_dict, save_hf
from rollouts.weights.files import publish_weights, weight_bytes


def save_pretrained_way(backend, root: Path, version: str) -> Path:
    """A sync's publish before `write_engine_files` and recycling."""
    dtype = backend.core.settings.engine_dtype
    state = engine_state_dict(backend.hf, backend._full_state_dict(dtype))
    state = {k: v.clone() if k == "lm_head.weight" else v for k, v in state.items()}
    tmp, final = root / f".tmp-v_{version}", root / f"v_{version}"
    save_hf(backend.hf, backend.tokenizer, tmp, state)
    tmp.rename(final)
    olds = sorted((p for p in root.glob("v_*") if p != final), key=lambda p: p.stat().st_mtime)
    for old in olds[:-1]:
        shutil.rmtree(old)
    return final


def timed(publish: Callable[[str], Path], version: str) -> tuple[tuple[float, float, float], Path]:
    """(seconds, user CPU, system CPU) of one publish, and its directory."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    out = publish(version)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (seconds, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-write-"))
    root = Path(tempfile.mkdtemp(prefix="bench-write-", dir="/dev/shm"))
    try:
        config = Config(
            model=ModelConfig(path=str(model_dir(args.model, work))),
            optim=OptimConfig(lr=2e-5, scheduler="constant"),
            training=TrainingConfig(device="cpu", autocast="bfloat16", micro_batch_tokens=2048),
        )
        backend = create_pytorch_backend(config)
        batch = rl_batch(int(backend.hf.config.vocab_size), **SHAPES[args.model])
        loss = make_loss_fn(AlgorithmConfig())

        async def steps() -> None:
            for _ in range(2):
                old = await backend.compute_logprobs(batch)
                await backend.forward_backward(
                    dataclasses.replace(batch, old_logprobs=tuple(old)), loss
                )
                await backend.optim_step()

        trio.run(steps)
        roots = {n: root / n for n in ("save_pretrained", "publish")}
        ways: dict[str, Callable[[str], Path]] = {
            "save_pretrained": lambda v: save_pretrained_way(backend, roots["save_pretrained"], v),
            "publish": lambda v: publish_weights(backend, roots["publish"], v),
        }
        for r in roots.values():
            r.mkdir()
        figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
        for r in range(args.rounds):
            outs = {}
            for name in ways if r % 2 == 0 else reversed(list(ways)):
                figure, outs[name] = timed(ways[name], str(r))
                figures[name].append(figure)
            if r in (0, args.rounds - 1):
                a, b = (read_safetensors_dir(outs[n]) for n in ways)
                assert set(a) == set(b), "the two ways wrote other tensors"
                assert all(torch.equal(a[n], b[n]) for n in a), "the two ways' files differ"
        size = weight_bytes(outs["publish"])
        print(f"{args.model}: {size / 1e6:.0f} MB of safetensors a publish, {args.rounds} rounds")
        print("way              seconds   user s   sys s   (medians)")
        med = {n: [statistics.median(c) for c in zip(*v, strict=True)] for n, v in figures.items()}
        for name, (s, u, y) in med.items():
            print(f"{name:16} {s:7.3f} {u:8.3f} {y:7.3f}")
        print(f"save_pretrained / publish: {med['save_pretrained'][0] / med['publish'][0]:.2f}x")
        backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
