"""CUDA graphs of the engine's decode step: one captured step per padded batch size.

On a GPU a decode step of a small model is bound by launching kernels, not by running them: on
an H200 the ~0.4B model's step (`fast_decode.decode`, 256 rows) launched ~970 kernels at ~6.5 us
each on the host while the GPU was busy 3.7 ms of its 18 ms. A CUDA graph replays the whole
step's kernels with one launch. What a graph needs, `fast_decode.decode_padded` gives: the
first P slots over every column of the cache (the mask hides the columns a row does not use),
the new key and value written at a column held in a device tensor, so shapes and addresses are
fixed for a given P and cache buffer. A batch of b rows replays the graph of the smallest
captured size P >= b; the slots `[b, P)` are free slots, run as padding (their logits are
dropped; each gets its column unmasked, so no row attends to nothing).

A graph reads the weights and the cache at the addresses it was captured with. The cache is
regrown by reallocating, and a sleep moves the weights off the GPU and back, so every step
checks a key (the cache buffers' and every parameter's address, the cache width) and captures
again when it changed; an in-place weight reload (`copy_`) keeps the addresses and the graphs.
`StepGraphs` is the `step` callable `kv.decode` takes; on other devices it is not used.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from rollouts.engine import fast_decode
from rollouts.engine.kv import SlotCache

log = logging.getLogger(__name__)


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to 32, of 16
    up to 128, of 32 beyond, and `max_batch` itself (vLLM's shape of the list, coarser)."""
    sizes = {1, 2, 4, max_batch}
    step, size = 8, 8
    while size < max_batch:
        sizes.add(size)
        if size >= 128:
            step = 32
        elif size >= 32:
            step = 16
        size += step
    return sorted(s for s in sizes if s <= max_batch)


class StepGraphs:
    """Captured decode steps for one model; `__call__(model, kv, tokens_B)` is a decode step.
    A capture that fails (a model whose step syncs with the host, say) is logged and the steps
    run uncaptured from then on (`fast_decode.decode`)."""

    def __init__(self, max_batch: int, capture: bool = True) -> None:
        self.sizes = graph_sizes(max_batch)
        # False: the same padded steps and bookkeeping, run without capturing (any device; the
        # tests check them on CPU against the unpadded step)
        self.capture = capture
        self.pool: Any = None  # one memory pool for all the graphs of a key
        self.key: tuple = ()
        self.graphs: dict[int, Captured] = {}
        self.captures = 0
        self.failed = ""  # why capturing failed ("" = it did not)

    def __call__(self, model: Any, kv: SlotCache, tokens_B: torch.Tensor) -> torch.Tensor:
        if self.failed:
            return fast_decode.decode(model, kv, tokens_B)
        b, t = kv.batch, kv.t
        key = (
            kv.cap,
            kv.keys[0].data_ptr(),
            kv.values[-1].data_ptr(),
            kv.mask_R_C.data_ptr(),
            kv.pos_R.data_ptr(),
            tuple(p.data_ptr() for p in model.parameters()),
        )
        if key != self.key:  # new cache buffers or moved weights: the old graphs read freed memory
            self.graphs.clear()
            self.pool = torch.cuda.graph_pool_handle() if self.capture else None
            self.key = key
        size = next(s for s in self.sizes if s >= b)
        if size > b:  # padding slots: their column unmasked, so each attends to something
            kv.mask_R_C[b:size, t] = 0
        captured = self.graphs.get(size)
        if captured is None:
            try:
                captured = self.graphs[size] = self._capture(model, kv, size)
            except Exception as e:  # any capture failure: run uncaptured from now on
                self.failed = f"{type(e).__name__}: {e}"
                self.graphs.clear()
                log.warning("CUDA graph capture failed, decoding without: %s", self.failed)
                return fast_decode.decode(model, kv, tokens_B)
        captured.tokens_P[:b].copy_(tokens_B)
        captured.col_1.fill_(t)
        if captured.graph is None:
            return fast_decode.decode_padded(model, kv, captured.tokens_P, captured.col_1)[:b]
        captured.graph.replay()
        return captured.logits_P_V[:b].clone()

    def _capture(self, model: Any, kv: SlotCache, size: int) -> Captured:
        """Capture the step for `size` rows (two warm-up runs on a side stream first, as
        PyTorch requires). The runs write this step's column of rows `[0, size)`; the replay
        that follows writes the same column again with the real tokens."""
        device = kv.pos_R.device
        tokens_P = torch.zeros(size, dtype=torch.long, device=device)
        col_1 = torch.full((1,), kv.t, dtype=torch.long, device=device)
        if not self.capture:
            return Captured(None, tokens_P, col_1, torch.empty(0))
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fast_decode.decode_padded(model, kv, tokens_P, col_1)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits_P_V = fast_decode.decode_padded(model, kv, tokens_P, col_1)
        self.captures += 1
        log.info("captured the decode step for %d rows (cache width %d)", size, kv.cap)
        return Captured(graph, tokens_P, col_1, logits_P_V)


@dataclasses.dataclass(frozen=True, slots=True)
class Captured:
    """One captured step: replaying `graph` reads `tokens_P` and `col_1`, writes `logits_P_V`."""

    graph: Any  # torch.cuda.CUDAGraph; None when not capturing
    tokens_P: torch.Tensor
    col_1: torch.Tensor
    logits_P_V: torch.Tensor
