"""Giving freed host memory back to the OS.

glibc keeps the pages of freed allocations in its arenas (one per thread that allocated), so a
process's RSS stays at its peak after large tensors are freed: the built-in engine's sleep, and
the SFT phase's backend (its worker thread's arena), would otherwise hold gigabytes that the
RL phase after them, or a colocated trainer, needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc


def give_back_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise: the RSS would not drop)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it keeps what it keeps
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_garbage() -> None:
    """Collect unreachable objects (a backend in a reference cycle), then give the heap back."""
    gc.collect()
    give_back_heap()
