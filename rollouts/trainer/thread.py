"""The training thread of a backend, and the training step handed to it.

All model work of a backend runs on one worker thread (a single-thread executor), in submission
order, and comes back as a `TrainFuture`. The training step's four calls (`forward_backward`,
`optim_step`, `compute_logprobs`, `compute_values`) are handed to it the same way by every
backend: what differs between one device and several ranks is the core's `Collective`, so each
backend takes these four as they are here.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rollouts.trainer.core import TrainerCore
from rollouts.trainer.protocol import Metrics
from rollouts.types import LossFn, TrainBatch, TrainFuture

T = TypeVar("T")


class TrainThread:
    """One backend's worker thread over its `TrainerCore`."""

    def __init__(self, core: TrainerCore) -> None:
        self.core = core
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")

    def submit(self, fn: Callable[..., T], *args: Any) -> TrainFuture[T]:
        """`fn(*args)` on the thread, in order after the work submitted before it."""
        return TrainFuture(self._executor.submit(fn, *args))

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False
    ) -> TrainFuture[Metrics]:
        """Accumulate gradients of `loss_fn` over `batch` (under FSDP every rank passes the whole
        batch and trains its share; metrics summed over ranks); see `TrainingBackend`."""
        return self.submit(self.core.forward_backward, batch, loss_fn, entropy)

    def optim_step(self) -> TrainFuture[Metrics]:
        """Clip the (global) gradient norm to `max_grad_norm`, step AdamW and the schedule, or
        skip a non-finite step."""
        return self.submit(self.core.optim_step)

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence logprobs of the whole batch under the current weights (no grad); under
        FSDP on every rank (each computes its share, then gathers)."""
        return self.submit(self.core.compute_logprobs, batch)

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence critic values of the whole batch (no grad, CPU float32), aligned like
        the logprobs."""
        return self.submit(self.core.compute_values, batch)

    def shutdown(self) -> None:
        """Finish the queued work, then stop the thread."""
        self._executor.shutdown(wait=True)
