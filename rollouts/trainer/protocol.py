"""The TrainingBackend Protocol: the only way a loop trains a model.

Work that touches the model runs on the backend's own worker thread and comes back as a
`TrainFuture`, so a trio loop can submit a step and keep serving rollouts. Under FSDP every rank
calls the same methods, in the same order, with the same (whole) batch; the backend splits it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from rollouts.types import LossFn, TrainBatch, TrainFuture

Metrics = dict[str, float]


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf loss or gradient."""


@runtime_checkable
class WeightSnapshots(Protocol):
    """A backend that can fix a step's weights at once and write them later, on another thread,
    while the next step trains (the one-device backend, in this process or in a trainer
    process). The overlapped disk sync uses it (`weights/publisher.py`)."""

    def snapshot_weights(self) -> object:
        """This step's weights, taken in order after the submitted work (opaque)."""
        ...

    def write_weights(self, snapshot: object, path: Path) -> None:
        """Write a snapshot as an engine's weight files in `path` (blocks the calling thread)."""
        ...


@runtime_checkable
class LoraAdapters(Protocol):
    """A backend that trains LoRA adapters on a frozen base model ([model.lora]): the adapter
    sync writes only the adapter, and the reference model is the base (the adapters off)."""

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        """Write the adapter as a PEFT directory in `path`, in order after the submitted work
        (what vLLM's and SGLang's adapter loaders read); its size in bytes."""
        ...

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        """Write the frozen base model as an engine's weight files in `path` (every tensor, a
        tied LM head too): what servers already up reload before their first adapter."""
        ...

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """`compute_logprobs` of the base model: the same weights with the adapters off."""
        ...


@runtime_checkable
class TrainingBackend(Protocol):
    """One model, its optimizer and schedule, on one device or sharded over ranks."""

    rank: int
    world_size: int

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False
    ) -> TrainFuture[Metrics]:
        """Accumulate the gradient of `loss_fn` over `batch` (micro-batched); summed metrics."""
        ...

    def optim_step(self) -> TrainFuture[Metrics]:
        """Clip, step the optimizer and the schedule, zero the gradients (skip if non-finite)."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence logprobs (no grad, CPU float32), aligned with `batch.input_ids`."""
        ...

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence critic values (no grad, CPU float32), aligned like the logprobs."""
        ...

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full HF state dict on CPU (on rank 0; other ranks get {}); with LoRA, the base
        with the adapter merged in."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy a full HF state dict into the model (every rank passes the full dict)."""
        ...

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        """Write model (HF), tokenizer, optimizer, scheduler and counters into directory `path`."""
        ...

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        """Restore what `save_checkpoint` wrote."""
        ...

    def save_weights(self, path: Path) -> TrainFuture[None]:
        """Write only what an engine needs to reload (HF safetensors + config + tokenizer); with
        LoRA, the merged model."""
        ...

    def weight_snapshots(self) -> WeightSnapshots | None:
        """The backend's snapshot capability, or None (weights are written when published)."""
        ...

    def lora_adapters(self) -> LoraAdapters | None:
        """The backend's adapters when it trains LoRA, else None."""
        ...

    def pin_thread(self, cores: Collection[int]) -> None:
        """Run the training thread on `cores` (a no-op where torchrun places the ranks)."""
        ...

    def barrier(self) -> None:
        """Wait for every rank (a no-op on one device)."""
        ...

    def close(self) -> None:
        """Stop the worker thread (and, under FSDP, the process group)."""
        ...
