"""What crosses the trainer process's socket (`process.py`, `process_child.py`): pickles, with
a TrainBatch's per-sequence tensors packed into one buffer per field."""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import torch

from rollouts.types import TrainBatch

HOST = -1  # calls addressed to the child itself, not to one of its backends


@dataclasses.dataclass(frozen=True, slots=True)
class _Ragged:
    """A tuple of 1-D tensors as one flat tensor and the lengths: one pickled buffer instead of
    one per sequence (128 sequences x 5 fields took 30 ms to pickle and unpickle one by one).
    A CPU tensor's bytes go as a numpy array, which pickles and unpickles in one copy each (a
    tensor goes through `torch.save`: 2-2.5x the time, 0.6 s of an 8k-sample step's tail)."""

    flat: Any  # numpy uint8 (the bytes of a CPU tensor of `dtype`), or the tensor itself
    dtype: torch.dtype
    lengths: tuple[int, ...]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        flat = self.flat
        if not isinstance(flat, torch.Tensor):
            flat = torch.from_numpy(flat).view(self.dtype)
        return tuple(torch.split(flat, self.lengths))


def _ragged(tensors: tuple[torch.Tensor, ...]) -> _Ragged:
    flat = torch.cat(tensors)
    lengths = tuple(len(t) for t in tensors)
    if flat.device.type != "cpu" or flat.requires_grad:  # pickled as a tensor, as it is
        return _Ragged(flat, flat.dtype, lengths)
    return _Ragged(flat.view(torch.uint8).numpy(), flat.dtype, lengths)


@dataclasses.dataclass(frozen=True, slots=True)
class _PackedBatch:
    """A TrainBatch's fields with every per-sequence tuple packed (`_Ragged`)."""

    fields: dict[str, Any]


def _is_ragged(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in value)
        and len({t.dtype for t in value}) == 1
    )


def pack(value: Any) -> Any:
    """What crosses the socket for `value`: batches and tuples of 1-D tensors packed."""
    if isinstance(value, TrainBatch):
        fields = {f.name: pack(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return _PackedBatch(fields)
    if _is_ragged(value):
        return _ragged(value)
    return value


def unpack(value: Any) -> Any:
    """The inverse of `pack` (the tensors of a batch are views of one buffer per field)."""
    if isinstance(value, _PackedBatch):
        return TrainBatch(**{k: unpack(v) for k, v in value.fields.items()})
    if isinstance(value, _Ragged):
        return value.tensors()
    return value


def dumps(name: str, message: tuple, prefix: bytes = b"") -> memoryview:
    """`prefix` (the call's id), then `message` pickled, in one buffer: nothing copied again to
    join them (a step's batch is hundreds of MB); an error naming the call `name` and the fix
    when it cannot be pickled."""
    buffer = io.BytesIO()
    buffer.write(prefix)
    try:
        pickle.dump(message, buffer, protocol=pickle.HIGHEST_PROTOCOL)
        return buffer.getbuffer()
    except Exception as e:
        raise TypeError(
            f"{name}: cannot send its arguments to the trainer process ({e}); pass picklable "
            "objects (module-level functions, not lambdas), or set training.trainer_process = "
            "'off' to train in this process"
        ) from e
