"""Shared helpers of the backend tests: a tiny batch, a local NLL loss, a tiny config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollouts.config import Config, LoraConfig, ModelConfig, OptimConfig, TrainingConfig
from rollouts.types import ModelOutputs, PlainLoss, TrainBatch

LENGTHS = [5, 9, 3, 12, 7, 7]


def masked_nll(outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked token-sum NLL normalised by the WHOLE batch's token count (token-mean overall)."""
    total = sum(
        -(lp * mask.to(lp.dtype)).sum()
        for lp, mask in zip(outputs.logprobs, batch.loss_mask, strict=True)
    )
    loss = total / batch.num_global_tokens
    return loss, {"nll": float(loss.detach())}


nll_loss = PlainLoss(fn=masked_nll)  # the LossFn of the backend tests


def make_batch(lengths: list[int], seed: int = 0, vocab: int = 200) -> TrainBatch:
    """Random token sequences; every token but the first is trained."""
    g = torch.Generator().manual_seed(seed)
    ids = tuple(torch.randint(3, vocab, (n,), generator=g) for n in lengths)
    masks = tuple(torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in lengths)
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        num_global_tokens=float(sum(n - 1 for n in lengths)),
        num_global_seqs=float(len(lengths)),
    )


def tiny_config(model_dir: Path, **training: Any) -> Config:
    """A CPU config for the tiny model (fp32, one warmup step, cosine to half the lr)."""
    return Config(
        model=ModelConfig(path=str(model_dir)),
        optim=OptimConfig(lr=1e-2, warmup_steps=1, min_lr_ratio=0.5, max_grad_norm=1.0),
        training=TrainingConfig(device="cpu", rl_steps=10, **training),
    )


STEP_BATCHES = [make_batch([6, 9, 4], seed=s) for s in range(4)]


def train_steps(backend: Any, steps: range) -> None:
    """One optimizer step on `STEP_BATCHES[s]` for each s in `steps` (the NLL loss)."""
    for s in steps:
        backend.forward_backward(STEP_BATCHES[s], nll_loss).result()
        backend.optim_step().result()


def straight_and_resumed(
    config: Config, root: Path, read: Callable[[Any], dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Path]:
    """`read` of a backend after 4 steps straight on, and after 2 steps, a checkpoint in `root`
    and 2 more steps in a fresh backend resumed from it; and the checkpoint's path."""
    from rollouts.trainer.checkpoint import (
        find_latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from rollouts.trainer.factories import create_pytorch_backend

    straight = create_pytorch_backend(config)
    train_steps(straight, range(4))
    expected = read(straight)
    straight.close()
    first = create_pytorch_backend(config)
    train_steps(first, range(2))
    path = save_checkpoint(first, root, step=2, weight_version="2")
    first.close()
    second = create_pytorch_backend(config)
    load_checkpoint(second, find_latest_checkpoint(root))
    train_steps(second, range(2, 4))
    resumed = read(second)
    second.close()
    return expected, resumed, path


FSDP_FROZEN = ["layers.0.mlp"]  # layer 0's MLP: a unit of frozen and trained parameters


def fsdp_config(model_dir: Path) -> Config:
    """The FSDP tests' config (both backends): `tiny_config`, 16-token micro-batches, and
    layer 0's MLP frozen (`model.freeze`)."""
    config = tiny_config(model_dir, micro_batch_tokens=16)
    return dataclasses.replace(config, model=ModelConfig(path=str(model_dir), freeze=FSDP_FROZEN))


def lora_config(model_dir: Path, **lora: Any) -> Config:
    """`tiny_config` with rank-4 LoRA adapters on every linear layer."""
    config = tiny_config(model_dir)
    table = LoraConfig(enabled=True, rank=4, alpha=8.0, **lora)
    return dataclasses.replace(config, model=ModelConfig(path=str(model_dir), lora=table))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine OpenMP spin-waits make tiny models 30x
    slower. Import it into a test module to make it autouse there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
