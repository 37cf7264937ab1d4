"""The critic head under FSDP2 (`torchrun --nproc_per_node 2`, gloo on CPU) matches one process:
values, value-loss steps (ranks run different numbers of micro-batches), the checkpoint round trip
of the head, and an HF export without it. This module is also the torchrun worker."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import AlgorithmConfig, Config, GAEConfig
from rollouts.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollouts.trainer.factories import create_backend
from rollouts.trainer.pytorch import load_hf_weights
from rollouts.types import TrainBatch
from tests import programs
from tests.training.backend_helpers import LENGTHS, make_batch, one_torch_thread, tiny_config

REPO = Path(__file__).resolve().parents[2]
_ = one_torch_thread  # autouse fixture


def critic_config(model_dir: Path) -> Config:
    base = tiny_config(model_dir, micro_batch_tokens=16)
    gae = GAEConfig(value_coef=1.0, value_clip=10.0, value_lr=1e-2)
    algo = AlgorithmConfig(advantage="gae", gae=gae)
    return dataclasses.replace(base, algorithm=algo)


def value_batch(backend, seed: int) -> TrainBatch:
    batch = make_batch(LENGTHS, seed=seed)
    values = backend.compute_values(batch).result()
    returns = tuple(m * (0.5 + 0.1 * i) for i, m in enumerate(batch.loss_mask))
    return dataclasses.replace(
        batch,
        advantages=tuple(torch.zeros_like(m) for m in batch.loss_mask),
        old_logprobs=tuple(backend.compute_logprobs(batch).result()),
        old_values=tuple(values),
        returns=returns,
    )


def run_steps(backend, config: Config) -> dict:
    loss_fn = make_loss_fn(config.algorithm)
    losses = []
    for step in range(2):
        losses.append(backend.forward_backward(value_batch(backend, step), loss_fn).result())
        backend.optim_step().result()
    values = backend.compute_values(make_batch(LENGTHS, seed=9)).result()
    return {"losses": [m["value_loss"] for m in losses], "values": values}


def worker(model_dir: str, out: str, ckpt_dir: str) -> None:
    config = critic_config(Path(model_dir))
    backend = create_backend(dataclasses.replace(config, training=_fsdp(config)))
    result = run_steps(backend, config)
    path = save_checkpoint(backend, ckpt_dir, step=2, weight_version="2")
    exported = backend.get_weights()
    backend.forward_backward(value_batch(backend, 5), make_loss_fn(config.algorithm)).result()
    backend.optim_step().result()  # moves the head away from the checkpoint
    load_checkpoint(backend, path)
    resumed = backend.compute_values(make_batch(LENGTHS, seed=9)).result()
    if backend.rank == 0:
        result |= {"resumed": resumed, "exported_keys": sorted(exported), "path": str(path)}
        torch.save(result, out)
    backend.close()


def _fsdp(config: Config):
    return dataclasses.replace(config.training, backend="fsdp")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_critic_under_fsdp_matches_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()),
        *programs.FORKED_RANK, "-m", "tests.training.test_critic_fsdp",
        str(tiny_model_dir), str(out), str(tmp_path / "ckpt"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = programs.run(cmd, cwd=REPO, env=env, timeout=180)  # forked, and each rank
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    fsdp = torch.load(out, weights_only=False)
    config = critic_config(tiny_model_dir)
    backend = create_backend(config)
    try:
        single = run_steps(backend, config)
    finally:
        backend.close()
    assert fsdp["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    assert fsdp["losses"][1] < fsdp["losses"][0]
    for a, b in zip(fsdp["values"], single["values"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(fsdp["resumed"], fsdp["values"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert fsdp["exported_keys"] and not any("value" in k for k in fsdp["exported_keys"])
    model_keys = load_hf_weights(Path(fsdp["path"]) / "model")
    assert not any("value" in k for k in model_keys)


if __name__ == "__main__":
    worker(*sys.argv[1:4])
    # skip the interpreter's teardown: see tests/training/fsdp_worker.py
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
