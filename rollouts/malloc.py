"""glibc's malloc told to keep what a training step frees, for the next step to reuse.

A training step on CPU allocates and frees gigabytes in large blocks: the LM head's [tokens,
vocab] logits, their log-softmax and gradients (400 MB each in float32 for a 2048-token SmolLM2
micro-batch), the activations. glibc serves each block over 32 MB with a fresh `mmap` and
returns it with `munmap` when freed, so the next step touches new pages again: 2.7 GB of page
faults a SmolLM2 step (690k faults, about 2 s of kernel time on the 2-core box). And a block
asked for by the trainer's thread comes from that thread's arena, whose heaps cannot hold it.

`keep_freed_memory` makes every allocation come from the one main heap (one arena, no `mmap`)
and never trims that heap, so a step reuses the pages of the last one. Measured with the
backend's step on SmolLM2 (8 x 256 tokens, bf16 autocast, 10 steps a run, runs in turn):
page faults 8.0M -> 1.8M, kernel time 19.6-27.7 s -> 7.6-8.7 s, a step's median 7.7-8.9 s ->
6.4-6.8 s. The process keeps its peak memory (it is reused, not returned to the system).

The driver (`rollouts train`, `integration_training/train.py`: it hosts the trainer in sync
mode and under torchrun) and the trainer process call it; engine servers do not (a sleeping
engine returns its memory to the system). `ROLLOUTS_MALLOC=system` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory in one heap (see the module's doc); True when
    it took. A no-op (False) off Linux, without glibc's `mallopt`, or with
    `ROLLOUTS_MALLOC=system`."""
    if os.environ.get("ROLLOUTS_MALLOC", "") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
