"""Timing helper shared by the benchmark scripts (run from scripts/, so importable by name)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], None], device: str, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up (CUDA synchronised)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
