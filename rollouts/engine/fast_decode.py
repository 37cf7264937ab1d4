"""One decode step of a Llama-family model without the HF forward (the engine's default path).

A decode step of a small model is mostly per-op cost, not arithmetic: the HF forward of the
demo's tiny Llama runs about 1500 aten ops a step at 128 rows (mask handling, output capture,
module hooks, `repeat_kv` copies of the whole KV cache under grouped-query attention), and its
SDPA call takes the CPU flash kernel, built for long queries, for a one-token query. This step
computes the same function as HF's eager attention path in fewer, larger ops:

- every weight is read from the model's own modules at each step (`F.linear(x, proj.weight,
  proj.bias)`), never copied or fused, so a weight reload or a merged LoRA adapter is what the
  next step computes with;
- the query heads of one KV head attend together (`[B, kv_heads, groups, D] @ K^T`), so the
  cache is read once, not copied per query head;
- RMSNorm, RoPE (the model's own rotary module: every rope type HF supports), the attention
  softmax in float32 and the residual order are HF's.

`unsupported(model)` says why a model takes the HF forward instead (another architecture, an
activation other than SiLU, sliding-window layers, ...). Against HF's forward the logits agree
to float rounding (`tests/engine/test_fast_decode.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rollouts.engine import precision
from rollouts.engine.kv import SlotCache, spans

# the architectures whose decoder layer this step implements (Qwen2 adds q/k/v biases, which
# `F.linear` takes from the modules)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported(model: Any) -> str:
    """Why `model` cannot take this step ("" when it can)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} (this step implements {', '.join(ARCHITECTURES)})"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (this step implements silu)"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (this step implements full attention only)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp {config.pretraining_tp}"
    layers = model.model.layers
    if len(layers) != config.num_hidden_layers:
        return f"{len(layers)} layers against num_hidden_layers {config.num_hidden_layers}"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj)
        if not all(type(p) is torch.nn.Linear for p in (*parts, mlp.down_proj)):
            return "a projection that is not a plain nn.Linear (a wrapped or quantized module)"
    return ""


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm: in float32, cast back, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on `x` [B, heads, D] with cos/sin [B, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def decode(model: Any, kv: SlotCache, tokens_B: torch.Tensor) -> torch.Tensor:
    """One decode step for every active slot of `kv` (the caller reserved column `kv.t` and
    unmasked it): writes each layer's key and value at `kv.t`, returns the logits_B_V."""
    b, (j, at) = kv.batch, divmod(kv.t, kv.block)

    def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        keys[j, :b, :, at] = k
        values[j, :b, :, at] = v

    with precision.context(model):
        return _step(model, kv, tokens_B, kv.first_col(), kv.t + 1, write)


@torch.inference_mode()
def decode_padded(model: Any, kv: SlotCache, tokens_P: torch.Tensor, col_1: torch.Tensor):
    """The same step for the first P = len(tokens_P) slots over every column of the cache, the
    key and value written at the column held in `col_1` (a one-element device tensor): for a
    given P and cache buffers, every shape and address is fixed, as a CUDA graph needs
    (`graphs.py`). Slots past the batch are padding (their logits are not used; they write
    only into their own free cache rows); each must leave column `col_1` unmasked, so that no
    row attends to nothing. The caller reserved and unmasked the column, as for `decode`."""
    rows = int(tokens_P.shape[0])
    assert kv.batch <= rows <= kv.rows, f"{kv.batch=} {rows=} {kv.rows=}"
    if kv.keys[0].shape[0] == 1:  # one block of every column (a GPU's cache)

        def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            keys[0, :rows].index_copy_(2, col_1, k.unsqueeze(2))
            values[0, :rows].index_copy_(2, col_1, v.unsqueeze(2))

    else:  # blocks (a CPU's cache): the block and the column in it, still device tensors
        block_1 = torch.div(col_1, kv.block, rounding_mode="floor")
        at_1 = col_1 - block_1 * kv.block

        def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            keys[block_1, :rows, :, at_1] = k.unsqueeze(0)
            values[block_1, :rows, :, at_1] = v.unsqueeze(0)

    with precision.context(model):
        return _step(model, kv, tokens_P, 0, kv.cap, write)


def _step(
    model: Any, kv: SlotCache, tokens_B: torch.Tensor, lo: int, hi: int, write: Any
) -> torch.Tensor:
    """The decoder over rows `[0, B)` of the cache: this step's keys and values go through
    `write(keys, values, k, v)`, attention reads columns `[lo, hi)` under the cache's mask (the
    callers enter the model's autocast, if it was mixed for one: `precision.py`)."""
    b = int(tokens_B.shape[0])
    lo, hi = _columns_read(kv, lo, hi)
    blocks = list(spans(kv.block, lo, hi))
    inner = model.model
    h = inner.embed_tokens(tokens_B)  # [B, hidden]
    cos, sin = inner.rotary_emb(h, kv.pos_R[:b].unsqueeze(1))  # [B, 1, D] each
    mask = kv.mask_R_C[:b, lo:hi].view(b, 1, 1, -1)
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, h)
        d = attn.head_dim
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, -1, d)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, -1, d)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, -1, d)
        kv_heads = k.shape[1]
        keys, values = kv.keys[i], kv.values[i]
        write(keys, values, _rope(k, cos, sin), v)
        q = _rope(q, cos, sin).view(b, kv_heads, -1, d)  # [B, kv_heads, groups, D]
        pieces = [(keys[j, :b, :, at:end], values[j, :b, :, at:end]) for j, at, end, _ in blocks]
        out = _attend(q, pieces, mask, attn.scaling).reshape(b, -1)
        h = h + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        x = _rms_norm(layer.post_attention_layernorm, h)
        gate = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        h = h + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
    h = _rms_norm(inner.norm, h)
    return model.lm_head(h)


def _columns_read(kv: SlotCache, lo: int, hi: int) -> tuple[int, int]:
    """The columns the attention reads, block by block in place: a blocked cache (an engine on
    one CPU thread, `kv.blocked_cache`) in whole blocks, each one contiguous tensor (the extra
    columns are masked); one block, as asked."""
    if not kv.blocked:
        return lo, hi
    return lo - lo % kv.block, -(-hi // kv.block) * kv.block


def _attend(
    q: torch.Tensor,
    pieces: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of q `[B, kv_heads, groups, D]` over the cache's columns in `pieces` (keys and
    values `[B, kv_heads, n, D]` each, in column order), in float32 softmax as HF's eager path;
    several pieces' values weigh in by a matmul each, summed in float32."""
    q_t = q.transpose(2, 3)
    # K @ q^T, not q @ K^T: the live keys are a plain row-major [L, D] block per head, which
    # matmul reads in place (a transposed one was copied first in bf16: 1.5x the attention)
    parts = [torch.matmul(k, q_t) for k, _ in pieces]
    scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).transpose(2, 3)
    scores = scores * scaling
    probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    if len(pieces) == 1:
        return torch.matmul(probs, pieces[0][1])
    out, at = None, 0
    for _, v in pieces:
        n = int(v.shape[2])
        part = torch.matmul(probs[..., at : at + n], v).float()
        out, at = (part if out is None else out.add_(part)), at + n
    assert out is not None
    return out.to(q.dtype)
