"""Host memory and glibc's malloc: freed memory kept for the next training step to reuse, and
given back to the OS where a phase ends.

Giving back (`give_back_heap`, `release_garbage`): glibc keeps the pages of freed allocations
in its arenas, so a process's RSS stays at its peak after large tensors are freed: the built-in
engine's sleep, and the SFT phase's backend, would otherwise hold gigabytes that the RL phase
after them, or a colocated trainer, needs. `malloc_trim(0)` returns them, whatever the settings
below.

Keeping (`keep_freed_memory`): a training step on CPU allocates and frees gigabytes in large
blocks: the LM head's [tokens, vocab] logits, their log-softmax and gradients (400 MB each in
float32 for a 2048-token SmolLM2 micro-batch), the activations. glibc serves each block over
32 MB with a fresh `mmap` and unmaps it when freed, so the next step faults in new pages again:
about 2.7 GB (690k faults, some 2 s of kernel time) a SmolLM2 step on the 2-core box. A block
asked for on the trainer's thread comes from that thread's arena, whose heaps cannot hold it.
`keep_freed_memory` makes every allocation come from the one main heap (one arena, no `mmap`)
and turns automatic trimming off, so a step reuses the last one's pages. The backend's step on
SmolLM2 (8 x 256 tokens, bf16 autocast, 10 steps a run, runs in turn): page faults 8.0M ->
1.8M, kernel time 19.6-27.7 s -> 7.6-8.7 s, a step's median 7.7-8.9 s -> 6.4-6.8 s. The process
keeps its peak memory for reuse. The driver (`rollouts train`, `integration_training/train.py`:
it hosts the trainer in sync mode and under torchrun), the trainer process and the built-in
engine's server (`rollouts serve`) call it. An engine's decode step allocates its sampling
temporaries over the vocabulary (SmolLM2 in bf16 at 128 rows: the logits in float32 and their
softmax, 25 MB each) and frees them; under glibc's defaults each step faulted about 12k fresh
pages, and its sampling took 28 ms instead of 8 (one thread; `scripts/bench_engine_malloc.py`).
A sleeping engine still gives its pages back (`give_back_heap` trims whatever the settings).
`ROLLOUTS_MALLOC=system` leaves glibc's defaults; `heap_mode()` says which a process runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys


def _libc() -> ctypes.CDLL:
    """glibc, for its malloc controls (OSError where there is none)."""
    return ctypes.CDLL("libc.so.6")


def give_back_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise: the RSS would not drop)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it keeps what it keeps
        _libc().malloc_trim(0)


def release_garbage() -> None:
    """Collect unreachable objects (a backend in a reference cycle), then give the heap back."""
    gc.collect()
    give_back_heap()


M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim


_kept = False  # keep_freed_memory took in this process


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory in one heap (see the module's doc); True when
    it took. A no-op (False) off Linux, without glibc's `mallopt`, or with
    `ROLLOUTS_MALLOC=system`."""
    global _kept
    if os.environ.get("ROLLOUTS_MALLOC", "") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _kept = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _kept


def heap_mode() -> str:
    """ "keep" where `keep_freed_memory` took in this process, else "system" (glibc's defaults
    or another malloc)."""
    return "keep" if _kept else "system"
