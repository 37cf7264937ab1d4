"""One proxy for a backend that lives elsewhere: `RemoteBackend`, the `TrainingBackend` whose
every method is a named call sent, in order, to the real backend on the far side.

Two transports carry those calls, each behind a `BackendLink`: the trainer process
(`process.py`: pickled over a socket to one child process) and the torchrun mirror (`mirror.py`:
rank 0's calls broadcast to every rank, then run on its own shard). The method list, the paths
made absolute (the far side may have another working directory), the blocking calls and the
capabilities (`LoraAdapters`, `WeightSnapshots`) live here once; a link only moves a call and
says how the far backend pins, waits for its ranks and closes. An error of the far side comes
back through the call's future with its own type and words.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from rollouts.gcpolicy import gc_paused
from rollouts.trainer.protocol import Metrics
from rollouts.types import OPTIONAL_SEQUENCE_FIELDS, LossFn, TrainBatch, TrainFuture


class BackendLink(Protocol):
    """How a `RemoteBackend`'s calls reach its one far backend (in sending order)."""

    def call(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Run the far backend's method `name`; the future has its result (a future's result
        when it returns one) or its error. An argument that cannot be sent raises here."""
        ...

    def pin_thread(self, cores: tuple[int, ...]) -> None:
        """Place the far backend's training thread on `cores` (not waited for)."""
        ...

    def barrier(self) -> None:
        """Wait for every rank of the far backend."""
        ...

    def close(self) -> None:
        """Finish the far backend's queued work and stop it (a gone far side: nothing to do)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class WeightSnapshot:
    """Weights copied on the far side (by `snapshot_weights`), kept there until written."""

    key: int


class RemoteBackend:
    """A `TrainingBackend` (and its `LoraAdapters`, `WeightSnapshots` when the far backend has
    them) whose calls go over `link`; rank 0 of `world_size`."""

    rank = 0

    def __init__(
        self, link: BackendLink, *, world_size: int = 1, adapters: bool, snapshots: bool
    ) -> None:
        """`adapters`: the far backend trains LoRA (model.lora.enabled); `snapshots`: it keeps
        weight snapshots (a one-device backend)."""
        assert world_size >= 1, f"{world_size=}"
        self.link = link
        self.world_size = world_size
        self.adapters = adapters
        self.snapshots = snapshots

    def _call(self, name: str, *args: Any, **kwargs: Any) -> TrainFuture[Any]:
        with gc_paused():  # the call's arguments packed and pickled: a batch's buffers
            return TrainFuture(self.link.call(name, *args, **kwargs))

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False
    ) -> TrainFuture[Metrics]:
        """See `TrainingBackend.forward_backward` (`loss_fn` must pickle for the process)."""
        return self._call("forward_backward", batch, loss_fn, entropy=entropy)

    def optim_step(self) -> TrainFuture[Metrics]:
        """See `TrainingBackend.optim_step`."""
        return self._call("optim_step")

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """See `TrainingBackend.compute_logprobs` (the batch sent as `to_score` makes it)."""
        return self._call("compute_logprobs", to_score(batch))

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """See `TrainingBackend.compute_values` (the batch sent as `to_score` makes it)."""
        return self._call("compute_values", to_score(batch))

    def get_weights(self) -> dict[str, torch.Tensor]:
        """See `TrainingBackend.get_weights` (blocks)."""
        return self._call("get_weights").result()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """See `TrainingBackend.load_weights` (blocks)."""
        self._call("load_weights", dict(weights)).result()

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        """See `TrainingBackend.save_checkpoint`."""
        return self._call("save_checkpoint", _far(path))

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        """See `TrainingBackend.load_checkpoint`."""
        return self._call("load_checkpoint", _far(path))

    def save_weights(self, path: Path) -> TrainFuture[None]:
        """See `TrainingBackend.save_weights`."""
        return self._call("save_weights", _far(path))

    def weight_snapshots(self) -> RemoteBackend | None:
        """This proxy when the far backend takes snapshots (`snapshot_weights`,
        `write_weights`), else None (weights are written when published)."""
        return self if self.snapshots else None

    def snapshot_weights(self) -> WeightSnapshot:
        """Copy this step's weights on the far side (in order after the submitted work);
        `write_weights` writes them there, so they never cross the link."""
        assert self.snapshots, "snapshot_weights of a far backend without snapshots"
        return WeightSnapshot(self._call("snapshot_weights").result())

    def write_weights(self, snapshot: object, path: Path) -> None:
        """Write a snapshot's weight files (on the far side's writer thread, while the training
        thread goes on with the next step)."""
        assert isinstance(snapshot, WeightSnapshot), f"{type(snapshot)=}"
        self._call("write_weights", snapshot.key, _far(path)).result()

    def lora_adapters(self) -> RemoteBackend | None:
        """This proxy when the far backend trains LoRA adapters (their calls go over too)."""
        return self if self.adapters else None

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        """See `LoraAdapters.save_adapter`."""
        return self._call("save_adapter", _far(path))

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        """See `LoraAdapters.save_base_weights`."""
        return self._call("save_base_weights", _far(path))

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """See `LoraAdapters.compute_base_logprobs` (the batch sent as `to_score` makes it)."""
        return self._call("compute_base_logprobs", to_score(batch))

    def pin_thread(self, cores: Collection[int]) -> None:
        """See `TrainingBackend.pin_thread` (the link says how, or that torchrun places)."""
        self.link.pin_thread(tuple(cores))

    def barrier(self) -> None:
        """See `TrainingBackend.barrier`."""
        self.link.barrier()

    def close(self) -> None:
        """Stop the far backend (what else lives on the far side stays)."""
        self.link.close()


def to_score(batch: TrainBatch) -> TrainBatch:
    """`batch` as a far backend scores it: tokens, loss mask, normalisers and metadata, which
    are all its logprobs and values read (`TrainerCore._per_token`); the rest is not pickled
    (an 8k-sample GRPO batch: 180 -> 108 MB)."""
    return dataclasses.replace(batch, **dict.fromkeys(OPTIONAL_SEQUENCE_FIELDS, ()))


def _far(path: Path) -> Path:
    """`path` as the far side must read it: absolute (its working directory may differ)."""
    return Path(path).absolute()
