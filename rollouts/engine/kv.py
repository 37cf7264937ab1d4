"""The running batch's KV cache: pre-allocated slots on one shared timeline, and the forwards.

Every layer's keys and values live in one buffer `[blocks, rows, kv_heads, block, head_dim]`,
allocated once and grown by doubling (never concatenated per step). An engine on one CPU thread
keeps the columns in blocks of BLOCK_COLS, each block's first b rows one contiguous tensor, and
the attention's batched matmuls read whole blocks in place: a column slice of one `[rows, heads,
capacity, dim]` buffer is strided, and oneDNN's batched bf16 matmul copies it first (one
thread: SmolLM2's decode step 1.05x at 100 columns, 1.13x at 250, 1.19x at 600; the tiny
model's within the noise; `scripts/bench_kv_blocks.py`). On several threads the copy costs less
than a matmul a block (SmolLM2 0.91-1.05x), and on a GPU cuBLAS reads the strided slice in
place: there the buffer is one block of every column, one matmul a layer. The layout is chosen
once, when the engine starts (`blocked_cache`), so a thread governor's switches never change its
numbers.

Active rows are the dense slots `[0, batch)`; all of them write their next token at the same
column `t`, so a row's tokens sit at the right end of `[start, t)` and the columns left of
`start` are hidden by an additive mask kept in a `[rows, capacity]` buffer (a 4D view of it goes
to the model as is, so no mask is rebuilt per step; positions are a per-slot counter). A
retired row's slot is refilled by moving the last active row into it. New rows are prefilled
together in a plain `DynamicCache` (each distinct prompt once) and their keys/values copied
into their slots.
`SlotCache` is duck-typed as an HF cache: attention layers only call `update`.

Prompts that start alike are prefilled once up to where they part (`prefill` with a
`SharedPrefix`): an agent's prompts all begin with the same system message (its tools'
description, most of a short prompt), and a GRPO group's with the same question. Their common
prefix runs once, in one row; each prompt's rest runs on top of it, left-padded after the prefix,
so a row's cache is `[prefix][padding][rest]` (the padding masked like the left padding before
it). The prefix's keys and values are kept for the next admission while the weights stay the
same (a multi-turn episode's next turn, sent alone, starts with the same system message).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from rollouts.engine import precision

GROW_COLS = 64  # capacity is a multiple of this
# columns in a block of a blocked cache (a divisor of GROW_COLS)
BLOCK_COLS = 64
# a common prefix shorter than this is prefilled with the rest of each prompt (sharing it would
# save less than the second forward costs)
MIN_SHARED = 32
# The attention reads columns from a multiple of this (<= lo; the extra ones are masked): CUDA's
# memory-efficient attention checks the mask's strides but not where its data starts, and a mask
# view starting at an odd column failed with "misaligned address" on the first H100 run.
ALIGN_COLS = 16


class SlotCache:
    """Per-layer K/V buffers, mask and positions for up to `rows` sequences."""

    def __init__(
        self,
        like: DynamicCache,
        rows: int,
        cap: int,
        dtype: torch.dtype | None = None,
        blocked: bool = False,
    ) -> None:
        """Buffers shaped after the prefill cache `like`, in `dtype` (default: `like`'s); in
        blocks of BLOCK_COLS columns when `blocked` (`blocked_cache`), else one block."""
        layers = list(like.layers)
        assert layers, "the prefill cache has no layers"
        _, heads, _, dim = layers[0].keys.shape
        dtype, device = dtype or layers[0].keys.dtype, layers[0].keys.device
        self.rows, self.cap, self.batch, self.t, self.lo = rows, cap, 0, 0, 0
        self.blocked = blocked  # else one block of every column
        self.block = math.gcd(BLOCK_COLS, GROW_COLS) if blocked else cap  # cap's divisor
        assert cap % self.block == 0, f"{cap=} is no multiple of {self.block}"
        shape = (cap // self.block, rows, heads, self.block, dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.neg = torch.finfo(dtype).min
        self.mask_R_C = torch.full((rows, cap), self.neg, dtype=dtype, device=device)
        self.pos_R = torch.zeros(rows, dtype=torch.long, device=device)
        self.start_R = torch.zeros(rows, dtype=torch.long, device=device)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: object, **__: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF cache hook (decode only): write column `t`, return the live columns."""
        assert key.shape[2] == 1, f"decode writes one column, got {key.shape=}"
        b, t = self.batch, self.t
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        j, at = divmod(t, self.block)
        keys[j, :b, :, at] = key[:, :, 0]
        values[j, :b, :, at] = value[:, :, 0]
        live = (self.first_col(), t + 1)
        rows = slice(0, b)
        return read(keys, self.block, rows, *live), read(values, self.block, rows, *live)

    def first_col(self) -> int:
        """The first column the attention reads: `lo` rounded down to ALIGN_COLS (a column
        left of every row's start is masked, so the extra ones change nothing)."""
        return self.lo - self.lo % ALIGN_COLS

    def reserve(self, left: int, right: int) -> None:
        """Room for `left` columns before `t` and `right` columns from `t` on (moves or grows)."""
        if self.t >= left and self.t + right <= self.cap:
            return
        span = self.t - self.lo
        new_t = max(span, left)
        cap = self.cap
        while new_t + right > cap:
            cap *= 2
        b, src, dst = self.batch, slice(self.lo, self.t), slice(new_t - span, new_t)
        rows = slice(0, b)
        if cap != self.cap:
            block = self.block if self.blocked else cap
            grow = (self.block, block, cap, rows, src, dst)
            self.keys = [_regrown(k, *grow) for k in self.keys]
            self.values = [_regrown(v, *grow) for v in self.values]
            mask = self.mask_R_C.new_full((self.rows, cap), self.neg)
            mask[:b, dst] = self.mask_R_C[:b, src]
            self.mask_R_C, self.cap, self.block = mask, cap, block
        else:
            for buf in (*self.keys, *self.values):
                moved = read(buf, self.block, rows, src.start, src.stop).clone()
                write(buf, self.block, rows, dst.start, moved)
            self.mask_R_C[:b, dst] = self.mask_R_C[:b, src].clone()
        self.mask_R_C[:b, : dst.start] = self.neg
        # and right of the new t: a move left leaves the old columns' zeros there, which a step
        # reading every column (`fast_decode.decode_padded`) would attend to
        self.mask_R_C[:b, dst.stop :] = self.neg
        self.start_R[:b] += dst.start - self.lo
        self.t, self.lo = new_t, dst.start

    def place(self, prefill: DynamicCache, mask_U_W: torch.Tensor, which_N: torch.Tensor) -> None:
        """Append rows: new row i gets prefill row `which_N[i]`, its last token at column t-1."""
        n, width = int(which_N.shape[0]), int(mask_U_W.shape[1])
        assert self.batch + n <= self.rows, f"{self.batch=} + {n=} > {self.rows=}"
        self.reserve(width, 1)
        rows, cols = slice(self.batch, self.batch + n), slice(self.t - width, self.t)
        for layer, k, v in zip(prefill.layers, self.keys, self.values, strict=True):
            write(k, self.block, rows, cols.start, layer.keys.index_select(0, which_N))
            write(v, self.block, rows, cols.start, layer.values.index_select(0, which_N))
        real_N_W = mask_U_W.index_select(0, which_N).bool()
        self.mask_R_C[rows] = self.neg
        self.mask_R_C[rows, cols] = torch.zeros_like(self.mask_R_C[rows, cols]).masked_fill(
            ~real_N_W, self.neg
        )
        self.pos_R[rows] = real_N_W.sum(dim=1)
        # the first real column: a shared prefix leaves padding between it and the rest
        self.start_R[rows] = self.t - width + real_N_W.int().argmax(dim=1)
        self.batch += n
        self.lo = int(self.start_R[: self.batch].min())

    def move(self, dst: list[int], src: list[int], batch: int) -> None:
        """Copy slots `src` into `dst` (same order) and keep only `[0, batch)` active."""
        assert len(dst) == len(src), f"{len(dst)=} != {len(src)=}"
        if dst:
            d = torch.tensor(dst, device=self.pos_R.device)
            s = torch.tensor(src, device=self.pos_R.device)
            for buf in (*self.keys, *self.values):
                for j, at, end, _ in spans(self.block, self.lo, self.t):
                    buf[j, d, :, at:end] = buf[j, s, :, at:end]
            for buf in (self.mask_R_C, self.pos_R, self.start_R):
                buf[d] = buf[s]
        self.batch = batch
        if batch == 0:
            self.t = self.lo = 0
        else:
            self.lo = int(self.start_R[:batch].min())


def blocked_cache(device: torch.device) -> bool:
    """Whether an engine starting now keeps its cache in blocks: on a CPU, at one torch thread
    (the engine's count when it starts; later switches keep the layout)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def spans(block: int, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
    """Columns `[lo, hi)` of a blocked buffer, block by block: (block, first column in it, end
    in it, offset of that first column from `lo`)."""
    col = lo
    while col < hi:
        j, at = divmod(col, block)
        end = min(block, at + hi - col)
        yield j, at, end, col - lo
        col += end - at


def read(buf: torch.Tensor, block: int, rows: slice, lo: int, hi: int) -> torch.Tensor:
    """`[rows, heads, hi - lo, dim]`: columns `[lo, hi)` of the rows (a view inside one block,
    else a copy)."""
    parts = [buf[j, rows, :, at:end] for j, at, end, _ in spans(block, lo, hi)]
    if len(parts) <= 1:
        return parts[0] if parts else buf[0, rows, :, :0]
    return torch.cat(parts, dim=2)


def write(buf: torch.Tensor, block: int, rows: slice, lo: int, value: torch.Tensor) -> None:
    """`value` `[rows, heads, n, dim]` into columns `[lo, lo + n)` of the rows."""
    for j, at, end, off in spans(block, lo, lo + int(value.shape[2])):
        buf[j, rows, :, at:end] = value[:, :, off : off + end - at]


def _regrown(
    buf: torch.Tensor, block: int, new_block: int, cap: int, rows: slice, src: slice, dst: slice
) -> torch.Tensor:
    out = buf.new_zeros(cap // new_block, buf.shape[1], buf.shape[2], new_block, buf.shape[4])
    write(out, new_block, rows, dst.start, read(buf, block, rows, src.start, src.stop))
    return out


def start_cap(width: int, max_new: int) -> int:
    """Initial capacity: the first prompts plus their outputs, rounded up to GROW_COLS."""
    need = width + max(max_new, 1)
    return -(-need // GROW_COLS) * GROW_COLS


class SharedPrefix:
    """The keys and values of one token prefix under the weights loaded now (one row each
    layer), kept between admissions. `clear` whenever the weights change."""

    def __init__(self) -> None:
        self.tokens: tuple[int, ...] = ()
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # [1, heads, len, dim] each
        self.saved = 0  # prompt tokens not run thanks to sharing (the engine's stats)

    def clear(self) -> None:
        self.tokens, self.layers = (), []

    def common(self, prompts: list[list[int]]) -> int:
        """How many of its first tokens every prompt starts with."""
        n = len(self.tokens)
        for p in prompts:
            n = _common_len(self.tokens[:n], p)
            if not n:
                break
        return n

    def keep(self, tokens: list[int], cache: DynamicCache) -> None:
        self.tokens = tuple(tokens)
        self.layers = [(layer.keys, layer.values) for layer in cache.layers]


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def common_prefix_len(prompts: list[list[int]]) -> int:
    """The length of the token prefix all `prompts` share."""
    n = len(prompts[0])
    for p in prompts[1:]:
        n = _common_len(prompts[0][:n], p)
    return n


@torch.inference_mode()
def prefill(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    shared: SharedPrefix | None = None,
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Run the prompts (left-padded) through the model: (cache, mask_U_W, last logits_U_V).

    With `shared`, the prefix all prompts start with (a single prompt: all of it but its last
    token) runs once, from what `shared` holds of it on, and `shared` keeps it; each prompt's rest
    runs on top of it. A common prefix under MIN_SHARED tokens is not split off."""
    assert prompts, "prefill needs at least one prompt"
    assert all(prompts), f"empty prompt in {[len(p) for p in prompts]}"
    # every prompt keeps at least its last token after the prefix: its logits are the output
    split = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
    if shared is None or split < MIN_SHARED:
        return _forward(model, prompts, pad_id, None, 0)
    have = min(shared.common(prompts), split)
    past = [(k[:, :, :have], v[:, :, :have]) for k, v in shared.layers] if have else None
    shared.saved += split * len(prompts) - (split - have)
    if split > have:  # the prefix beyond what is kept: one row
        head, _, _ = _forward(model, [prompts[0][have:split]], pad_id, past, have)
        shared.keep(prompts[0][:split], head)
        past = [(layer.keys, layer.values) for layer in head.layers]
    return _forward(model, [p[split:] for p in prompts], pad_id, past, split)


def _forward(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    past_len: int,
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """The prompts left-padded, after `past` (one row of `past_len` columns per layer, shared
    by every prompt): (cache, mask over past and prompt columns, last logits)."""
    device = next(model.parameters()).device
    width, rows = max(len(p) for p in prompts), len(prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.ones((rows, past_len + width), dtype=torch.long)
    mask[:, past_len:] = 0
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, past_len + width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)[:, past_len:]
    cache = DynamicCache()
    if past is not None:
        cache = DynamicCache(
            [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in past]
        )
    with precision.context(model):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            # the last column, as an index: an int slices a view of the hidden states, and a
            # one-row view (one prompt, or a shared prefix) sent the CPU's bf16 LM head down a
            # path ~15x slower (118 against 8 ms, SmolLM2, torch 2.13): a gathered copy is not
            logits_to_keep=torch.tensor([width - 1], device=device),
        )
    return out.past_key_values, mask, out.logits[:, -1]


@torch.inference_mode()
def decode(
    model: torch.nn.Module,
    kv: SlotCache,
    tokens_B: torch.Tensor,
    step: Callable[[torch.nn.Module, SlotCache, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step for every active slot: feed `tokens_B`, return the next logits_B_V.
    `step` computes the logits and writes column `t` of the cache (`fast_decode.decode`);
    without one, the HF forward does, through `SlotCache.update`."""
    assert tokens_B.shape == (kv.batch,), f"{tokens_B.shape=} {kv.batch=}"
    kv.reserve(0, 1)
    b, t = kv.batch, kv.t
    kv.mask_R_C[:b, t] = 0
    if step is not None:
        logits_B_V = step(model, kv, tokens_B)
    else:
        with precision.context(model):
            logits_B_V = model(
                input_ids=tokens_B.unsqueeze(1),
                attention_mask=kv.mask_R_C[:b, None, None, kv.first_col() : t + 1],
                position_ids=kv.pos_R[:b].unsqueeze(1),
                past_key_values=kv,
                use_cache=True,
            ).logits[:, -1]
    kv.t += 1
    kv.pos_R[:b] += 1
    return logits_B_V
