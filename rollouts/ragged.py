"""Tuples of 1-D tensors as one buffer: what a TrainBatch's per-sequence fields are (views of
one flat tensor each, `algorithms/tensors.py`), and how they cross a process (`Ragged`: one
buffer and the lengths). torch pickles a view with its whole storage, once per view: a step's
8192 views of a 36 MB buffer would be 300 GB."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)` of 1-D tensors; without a copy when they are consecutive views of
    one contiguous 1-D tensor, in order (what `flat_views` makes, and a contiguous run of
    them): the view of that stretch of it."""
    assert tensors, "nothing to join"
    base = tensors[0]._base
    if base is not None and base.dim() == 1 and base.is_contiguous():
        start = expected = tensors[0].storage_offset()
        for t in tensors:
            if t._base is not base or t.storage_offset() != expected or t.stride() != (1,):
                break
            expected += t.shape[0]
        else:
            first = start - base.storage_offset()
            return base[first : first + expected - start]
    return torch.cat(list(tensors))


@dataclasses.dataclass(frozen=True, slots=True)
class Ragged:
    """A tuple of 1-D tensors as one flat tensor and the lengths: one pickled buffer instead of
    one per sequence (128 sequences x 5 fields took 30 ms to pickle and unpickle one by one).
    A CPU tensor's bytes go as a numpy array, which pickles and unpickles in one copy each (a
    tensor goes through `torch.save`: 2-2.5x the time, 0.6 s of an 8k-sample step's tail)."""

    flat: Any  # numpy uint8 (the bytes of a CPU tensor of `dtype`), or the tensor itself
    dtype: torch.dtype
    lengths: tuple[int, ...]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tuple again, as views of one buffer."""
        flat = self.flat
        if not isinstance(flat, torch.Tensor):
            flat = torch.from_numpy(flat).view(self.dtype)
        return tuple(torch.split(flat, self.lengths))


def is_ragged(value: Any) -> bool:
    """A non-empty tuple of 1-D tensors of one dtype."""
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in value)
        and len({t.dtype for t in value}) == 1
    )


def ragged(tensors: tuple[torch.Tensor, ...]) -> Ragged:
    """`tensors` (`is_ragged`) as one buffer: for views of one buffer, their stretch of it."""
    flat = joined(tensors)
    lengths = tuple(t.shape[0] for t in tensors)
    if flat.device.type != "cpu" or flat.requires_grad:  # pickled as a tensor, as it is
        if flat._base is not None:  # not its whole storage: only its own stretch
            flat = flat.clone()
        return Ragged(flat, flat.dtype, lengths)
    return Ragged(flat.view(torch.uint8).numpy(), flat.dtype, lengths)


def packed(value: Any) -> Any:
    """`ragged(value)` for a tuple of 1-D tensors, anything else as it is."""
    return ragged(value) if is_ragged(value) else value


def unpacked(value: Any) -> Any:
    """The inverse of `packed`."""
    return value.tensors() if isinstance(value, Ragged) else value
