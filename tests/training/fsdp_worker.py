"""Run under `torchrun --nproc_per_node 2`: 3 FSDP steps on the tiny model (layer 0's MLP frozen),
then a checkpoint.

Writes (rank 0) a torch file with the losses, final weights, logprobs, the HF export, and the
weights after a 4th step taken twice: straight on, and again after reloading the step-3 checkpoint.
Usage: python -m torch.distributed.run --nproc_per_node 2 fsdp_worker.py MODEL_DIR OUT CKPT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rollouts.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollouts.trainer.fsdp import create_fsdp_backend
from rollouts.trainer.pytorch import load_hf_weights
from tests.training.backend_helpers import LENGTHS, fsdp_config, make_batch, nll_loss


def main(model_dir: str, out: str, ckpt_dir: str) -> None:
    torch.manual_seed(0)
    backend = create_fsdp_backend(fsdp_config(Path(model_dir)))
    losses, metrics = [], {}
    for step in range(3):
        metrics = backend.forward_backward(make_batch(LENGTHS, seed=step), nll_loss).result()
        losses.append(metrics["loss"])
        backend.optim_step().result()
    weights = backend.get_weights()
    logprobs = backend.compute_logprobs(make_batch(LENGTHS, seed=9)).result()
    path = save_checkpoint(backend, ckpt_dir, step=3, weight_version="3")
    backend.forward_backward(make_batch(LENGTHS, seed=3), nll_loss).result()
    backend.optim_step().result()
    step4 = backend.get_weights()
    load_checkpoint(backend, path)
    backend.forward_backward(make_batch(LENGTHS, seed=3), nll_loss).result()
    backend.optim_step().result()
    step4_resumed = backend.get_weights()
    if backend.rank == 0:
        result = {
            "losses": losses,
            "metrics": metrics,
            "weights": weights,
            "logprobs": logprobs,
            "exported": load_hf_weights(path / "model"),
            "step4": step4,
            "step4_resumed": step4_resumed,
            "world_size": backend.world_size,
        }
        torch.save(result, out)
    backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # every file is written and the process group destroyed: skip the interpreter's teardown,
    # where gloo work objects still held by Python objects can abort the process (SIGABRT,
    # "terminate called without an active exception": rank 1 in CI, as in fsdp_lora_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
