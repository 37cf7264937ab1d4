"""Run under `torchrun --nproc_per_node 2`: LoRA under FSDP on the tiny model, every check's data
in one run (each torchrun start costs seconds).

3 steps, then (rank 0 writes OUT/result.pt): the losses, the merged weights, the base logprobs;
the adapter (OUT/adapter), the base weights (OUT/base) and a step-3 checkpoint (OUT/ckpt, with
the merged model); the adapter after a 4th step taken twice, straight on and after reloading
the checkpoint.
Usage: python -m torch.distributed.run --nproc_per_node 2 -m tests.training.fsdp_lora_worker
MODEL_DIR OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rollouts.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollouts.trainer.fsdp import create_fsdp_backend
from tests.training.backend_helpers import lora_config, make_batch, nll_loss

BATCHES = [make_batch([6, 9, 4, 7], seed=s) for s in range(5)]


def _step(backend, s: int) -> float:
    loss = backend.forward_backward(BATCHES[s], nll_loss).result()["loss"]
    backend.optim_step().result()
    return loss


def _adapter(backend, path: Path) -> dict[str, torch.Tensor]:
    backend.save_adapter(path).result()
    return load_file(path / "adapter_model.safetensors") if backend.rank == 0 else {}


def main(model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    backend = create_fsdp_backend(lora_config(Path(model_dir), save_merged=True))
    adapters = backend.lora_adapters()
    assert adapters is backend
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    held = [p for g in backend.core.optimizer.param_groups for p in g["params"]]
    assert trainable and all(".lora_" in n for n in trainable), trainable[:3]
    assert len(held) == len(trainable), f"{len(held)=} != {len(trainable)=}"
    losses = [_step(backend, s) for s in range(3)]
    size = adapters.save_adapter(out / "adapter").result()
    merged = backend.get_weights()
    base_logprobs = adapters.compute_base_logprobs(BATCHES[4]).result()
    logprobs = backend.compute_logprobs(BATCHES[4]).result()
    adapters.save_base_weights(out / "base").result()
    path = save_checkpoint(backend, out / "ckpt", step=3, weight_version="3")
    _step(backend, 3)
    step4 = _adapter(backend, out / "step4")
    load_checkpoint(backend, path)
    _step(backend, 3)
    step4_resumed = _adapter(backend, out / "step4_resumed")
    if backend.rank == 0:
        result = {
            "world_size": backend.world_size,
            "losses": losses,
            "adapter_bytes": size,
            "merged": merged,
            "base_logprobs": base_logprobs,
            "logprobs": logprobs,
            "checkpoint": str(path),
            "step4": step4,
            "step4_resumed": step4_resumed,
        }
        torch.save(result, out / "result.pt")
    backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # every file is written and the process group destroyed: skip the interpreter's teardown,
    # where gloo work objects still held by Python objects can abort the process (SIGABRT,
    # "terminate called without an active exception": rank 1 once in CI, after result.pt)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
