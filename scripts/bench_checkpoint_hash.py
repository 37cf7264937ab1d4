"""Benchmark: what the checksums of a checkpoint's manifest cost, against writing the checkpoint.

In one process, rounds write a SmolLM2-135M-sized checkpoint as the one-process backend writes
one (the model's real tensors in fp32 through safetensors `save_file`, an AdamW state of the same
shapes, step + exp_avg + exp_avg_sq, through `torch.save`: about 1.6 GB), then record its
manifest entries (`checkpoint_verify.record_files`: each file read back once, from the page
cache, and CRC-32'd), then verify it as a resume does (`verify_checkpoint`). Then the same files
hashed with sha256 and blake2b, to show why CRC-32. Prints median seconds and the ratios.

    .venv/bin/python scripts/bench_checkpoint_hash.py [--rounds 3] [--scale 1.0] [--dir /tmp]

`--scale 0.1` writes a tenth of the parameters (a quick look on a busy machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollouts.trainer.checkpoint_verify import CHUNK_BYTES, record_files, verify_checkpoint

SMOLLM2 = Path.home() / ".cache/rollouts/models/smollm2-135m-instruct"
SMOLLM2_PARAMS = 134_515_008


def model_state(scale: float) -> dict[str, torch.Tensor]:
    """SmolLM2-135M's tensors in fp32 (random ones of its size when it is not converted here),
    the first `scale` of them by parameter count."""
    files = sorted(SMOLLM2.glob("*.safetensors"))
    if files:
        state = {k: v.float() for f in files for k, v in load_file(f).items()}
    else:
        g = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(576, 1536, generator=g) for i in range(152)}
    budget, out = scale * sum(v.numel() for v in state.values()), {}
    for name, tensor in state.items():
        if budget <= 0:
            break
        out[name] = tensor.contiguous()
        budget -= tensor.numel()
    return out


def optimizer_state(state: dict[str, torch.Tensor]) -> dict:
    """An AdamW state dict for `state`'s tensors (made before the timing: not part of a write)."""
    return {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": v * 1e-3, "exp_avg_sq": v * v * 1e-6}
            for i, v in enumerate(state.values())
        },
        "param_groups": [{"lr": 1e-5, "params": list(range(len(state)))}],
    }


def write_checkpoint(path: Path, state: dict[str, torch.Tensor], optim: dict) -> None:
    """model/model.safetensors and optimizer.pt, as `PyTorchBackend.save_checkpoint` writes."""
    (path / "model").mkdir(parents=True)
    save_file(state, path / "model" / "model.safetensors")
    torch.save(optim, path / "optimizer.pt")


def hash_files(path: Path, make: Callable[[], object]) -> None:
    """Every file under `path` through a hashlib object, read as `record_files` reads."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h = make()
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(CHUNK_BYTES):
                    h.update(chunk)  # type: ignore[attr-defined]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(path: Path, state: dict[str, torch.Tensor], optim: dict) -> dict[str, float]:
    """Seconds of each part of one round, on a checkpoint written at `path`."""
    out = {"write": timed(lambda: write_checkpoint(path, state, optim))}
    out["crc32"] = timed(lambda: record_files(path))
    out["sha256"] = timed(lambda: hash_files(path, hashlib.sha256))
    out["b2b"] = timed(lambda: hash_files(path, hashlib.blake2b))
    manifest = {"format": 2, "step": 0, "files": record_files(path)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    out["verify"] = timed(lambda: verify_checkpoint(path))
    return out


def main() -> None:
    """Write, record and verify `--rounds` checkpoints; print the medians and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    state = model_state(args.scale)
    optim = optimizer_state(state)
    params = sum(v.numel() for v in state.values())
    rounds = []
    for r in range(args.rounds):
        path = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
        try:
            rounds.append(one_round(path / "c", state, optim))
            size = sum(f.stat().st_size for f in (path / "c").rglob("*") if f.is_file())
        finally:
            shutil.rmtree(path, ignore_errors=True)
        print(f"round {r}: " + " ".join(f"{k} {v:.2f}s" for k, v in rounds[-1].items()))
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    gb, write = size / 1e9, med["write"]
    print(f"checkpoint: {params / 1e6:.1f}M fp32 parameters, {gb:.2f} GB in 2 files")
    print(f"{'write (safetensors + torch.save):':37s} {write:.2f} s ({gb / write:.2f} GB/s)")
    for key, name in (
        ("crc32", "crc32 (the manifest's)"),
        ("sha256", "sha256"),
        ("b2b", "blake2b"),
    ):
        t = med[key]
        print(f"{name + ':':37s} {t:.2f} s ({gb / t:.2f} GB/s) = {t / write:.2f}x the write")
    t = med["verify"]
    print(f"{'verify on resume (crc32, read once):':37s} {t:.2f} s = {t / write:.2f}x the write")


if __name__ == "__main__":
    main()
