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
from rollouts.engine.kv import SlotCache

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
    b, t = kv.batch, kv.t

    def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        keys[:b, :, t] = k
        values[:b, :, t] = v

    cols = slice(kv.first_col(), t + 1)
    with precision.context(model):
        return _step(model, kv, tokens_B, kv.mask_R_C[:b, cols], cols, write)


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

    def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        keys[:rows].index_copy_(2, col_1, k.unsqueeze(2))
        values[:rows].index_copy_(2, col_1, v.unsqueeze(2))

    with precision.context(model):
        return _step(model, kv, tokens_P, kv.mask_R_C[:rows], slice(0, kv.cap), write)


def _step(
    model: Any,
    kv: SlotCache,
    tokens_B: torch.Tensor,
    mask_B_L: torch.Tensor,
    cols: slice,
    write: Any,
) -> torch.Tensor:
    """The decoder over rows `[0, B)` of the cache: this step's keys and values go through
    `write(keys, values, k, v)`, attention reads columns `cols` under `mask_B_L` (the callers
    enter the model's autocast, if it was mixed for one: `precision.py`)."""
    b = int(tokens_B.shape[0])
    inner = model.model
    h = inner.embed_tokens(tokens_B)  # [B, hidden]
    cos, sin = inner.rotary_emb(h, kv.pos_R[:b].unsqueeze(1))  # [B, 1, D] each
    mask = mask_B_L.view(b, 1, 1, -1)
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
        # K @ q^T, not q @ K^T: the live keys are a plain row-major [L, D] block per head, which
        # matmul reads in place (a transposed one was copied first in bf16: 1.5x the attention)
        scores = torch.matmul(keys[:b, :, cols], q.transpose(2, 3)).transpose(2, 3)
        scores = scores * attn.scaling
        probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values[:b, :, cols]).reshape(b, -1)
        h = h + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        x = _rms_norm(layer.post_attention_layernorm, h)
        gate = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        h = h + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
    h = _rms_norm(inner.norm, h)
    return model.lm_head(h)
