"""The torchrun process group seen by a backend: joining it, and the collectives `TrainerCore`
needs (each rank's share of a batch, sums and maxima over ranks, gathering logprobs, the global
gradient norm, the FSDP2 gradient-sync switch). gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollouts.trainer.batching import shard_indices


class DistCollective:
    """Reductions over the default process group; FSDP2 gradient-sync switch."""

    def __init__(self, model: Any) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._model = model
        self._device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")

    def local_indices(self, lengths: Sequence[int]) -> list[int]:
        return shard_indices(lengths, self.world_size, self.rank)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        all_keys: list[Any] = [None] * self.world_size
        dist.all_gather_object(all_keys, sorted(values))
        keys = sorted({k for ks in all_keys for k in ks})
        t = torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64)
        t = t.to(self._device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return dict(zip(keys, t.cpu().tolist(), strict=True))

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def set_grad_sync(self, enabled: bool) -> None:
        self._model.set_requires_gradient_sync(enabled)

    def gather(self, out: dict[int, torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, out)
        merged = {i: t for part in parts for i, t in part.items()}
        assert len(merged) == len(lengths), f"{len(merged)=} != {len(lengths)=}"
        return tuple(merged[i] for i in range(len(lengths)))

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the sharded gradients of `params` to the global `max_norm`; the global norm
        before, whole on every rank (FSDP2's is a DTensor)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


def init_distributed() -> torch.device:
    """Join the torchrun process group (gloo on CPU, nccl on GPU); the device of this rank."""
    if "RANK" not in os.environ:
        raise RuntimeError("training.backend = 'fsdp' must run under torchrun (no RANK in env)")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
        return device
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return torch.device("cpu")
