"""The machine's plain matmul rate at a model's shapes, and the share of it a phase reaches.

Shared by the engine and trainer benchmarks (run from scripts/, so importable by name). A phase's
model FLOPs per second (its tokens/s times the FLOPs of a token's matmuls) over the FLOP/s of the
same matmuls run bare, on the same cores, in the same dtype, in the same run: how much of what the
hardware does for this model the phase gets. The rest is attention over the cache, sampling,
Python, HTTP, the optimizer.

- Decode: 2 x (every linear layer's in x out, the LM head included) FLOPs a token, and the bare
  rate of `x[rows, in] @ W` for those shapes with `rows` the decode batch.
- Training: 6 x the same per token (forward, and backward's input and weight gradients), and the
  bare rate of the three matmuls of each linear layer at a micro-batch's rows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Shapes:
    """A decoder's linear layers as (in, out) pairs: one layer's, the layer count, the LM head."""

    layer: tuple[tuple[int, int], ...]
    layers: int
    head: tuple[int, int]

    @property
    def all(self) -> list[tuple[int, int]]:
        return [*self.layer * self.layers, self.head]

    @property
    def params(self) -> int:
        """Parameters that take part in matmuls (embeddings excluded, the LM head included)."""
        return sum(i * o for i, o in self.all)


def shapes_of(config) -> Shapes:
    """The linear shapes of a Llama-style HF config (q, k, v, o, gate, up, down; the head)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    q = config.num_attention_heads * head_dim
    layer = ((h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h))
    return Shapes(layer=layer, layers=config.num_hidden_layers, head=(h, config.vocab_size))


def _time(fn, seconds: float) -> float:
    """Median seconds of `fn` over runs filling about `seconds` (after two warm-ups)."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _operands(shapes: Shapes, rows: int, dtype: torch.dtype):
    """One layer's and the head's (in, out) pairs, an input of `rows` rows and a weight each."""
    pairs = [*shapes.layer, shapes.head]
    xs = [torch.randn(rows, i, dtype=dtype) for i, _ in pairs]
    ws = [torch.randn(o, i, dtype=dtype) / i**0.5 for i, o in pairs]
    return pairs, xs, ws


def decode_rate(
    shapes: Shapes, rows: int, dtype: torch.dtype, threads: int, seconds: float = 3.0
) -> float:
    """FLOP/s of `x[rows, in] @ W[in, out]` over one layer's shapes and the head, bare."""
    pairs, xs, ws = _operands(shapes, rows, dtype)

    def run() -> None:
        for x, w in zip(xs, ws, strict=True):
            torch.nn.functional.linear(x, w)

    with _threads(threads), torch.inference_mode():
        took = _time(run, seconds)
    return 2 * rows * sum(i * o for i, o in pairs) / took


def train_rate(
    shapes: Shapes, rows: int, dtype: torch.dtype, threads: int, seconds: float = 3.0
) -> float:
    """FLOP/s of each linear's forward, input-gradient and weight-gradient matmuls, bare."""
    pairs, xs, ws = _operands(shapes, rows, dtype)
    gs = [torch.randn(rows, o, dtype=dtype) for _, o in pairs]

    def run() -> None:
        for x, w, g in zip(xs, ws, gs, strict=True):
            torch.nn.functional.linear(x, w)  # forward
            g @ w  # d input
            g.t() @ x  # d weight

    with _threads(threads), torch.no_grad():
        took = _time(run, seconds)
    return 6 * rows * sum(i * o for i, o in pairs) / took


class _threads:
    """torch's intra-op threads set for a block, then restored."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


class pinned:
    """This process on `cores` for a block (Linux; elsewhere nothing), then as before."""

    def __init__(self, cores: Sequence[int]) -> None:
        self.cores = set(cores)
        self.old: set[int] | None = None

    def __enter__(self) -> None:
        if self.cores and hasattr(os, "sched_setaffinity"):
            self.old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cores)

    def __exit__(self, *exc: object) -> None:
        if self.old is not None:
            os.sched_setaffinity(0, self.old)


def share(tokens_per_s: float, flops_per_token: float, rate: float) -> float:
    """The phase's model FLOP/s over the bare matmul rate."""
    return tokens_per_s * flops_per_token / rate
