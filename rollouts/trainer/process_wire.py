"""What crosses the trainer process's socket (`process.py`, `process_child.py`): pickles, with
per-sequence tensors packed into one buffer per field (`rollouts/ragged.py`)."""

from __future__ import annotations

import io
import pickle
from typing import Any

from rollouts.ragged import packed, unpacked

HOST = -1  # calls addressed to the child itself, not to one of its backends


def pack(value: Any) -> Any:
    """What crosses the socket for `value`: a tuple of 1-D tensors as one buffer (a TrainBatch
    pickles its own fields so: `TrainBatch.__reduce__`)."""
    return packed(value)


def unpack(value: Any) -> Any:
    """The inverse of `pack` (the tensors are views of one buffer)."""
    return unpacked(value)


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
