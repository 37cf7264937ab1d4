"""The shared, left-padded KV cache of the running batch, and the two forward passes on it.

All rows share one `DynamicCache` of length T; a row's real tokens sit at the right end and its
left part is padding hidden by `mask_B_T`. New rows are prefilled together (left-padded) and
merged in by padding the shorter cache on the left; finished rows are dropped with an index
select, and columns that became padding in every row are trimmed away.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache


@dataclasses.dataclass(slots=True)
class BatchKV:
    """Cache, attention mask (1 = real token) and next position of every row."""

    cache: DynamicCache
    mask_B_T: torch.Tensor
    next_pos_B: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.mask_B_T.shape[0])


def _layers(cache: DynamicCache) -> list:
    return list(cache.layers)


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, prompts: list[list[int]], pad_id: int
) -> tuple[BatchKV, torch.Tensor]:
    """Run the prompts (left-padded) through the model; returns their cache and last logits_B_V."""
    assert prompts, "prefill needs at least one prompt"
    assert all(prompts), f"empty prompt in {[len(p) for p in prompts]}"
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = mask.sum(dim=1)
    return BatchKV(cache=out.past_key_values, mask_B_T=mask, next_pos_B=next_pos), out.logits[:, -1]


@torch.inference_mode()
def decode(model: torch.nn.Module, kv: BatchKV, tokens_B: torch.Tensor) -> torch.Tensor:
    """One decode step for every row: append `tokens_B`, return next logits_B_V (kv updated)."""
    assert tokens_B.shape == (kv.rows,), f"{tokens_B.shape=} {kv.rows=}"
    ones = torch.ones((kv.rows, 1), dtype=kv.mask_B_T.dtype, device=kv.mask_B_T.device)
    kv.mask_B_T = torch.cat([kv.mask_B_T, ones], dim=1)
    out = model(
        input_ids=tokens_B.unsqueeze(1),
        attention_mask=kv.mask_B_T,
        position_ids=kv.next_pos_B.unsqueeze(1),
        past_key_values=kv.cache,
        use_cache=True,
    )
    kv.cache = out.past_key_values
    kv.next_pos_B = kv.next_pos_B + 1
    return out.logits[:, -1]


def _left_pad(t: torch.Tensor, cols: int, dim: int) -> torch.Tensor:
    if cols == 0:
        return t
    shape = list(t.shape)
    shape[dim] = cols
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(a: BatchKV, b: BatchKV) -> BatchKV:
    """Rows of `a` then rows of `b` in one cache (the shorter one is left-padded)."""
    la, lb = _layers(a.cache), _layers(b.cache)
    assert len(la) == len(lb), f"{len(la)=} != {len(lb)=}"
    width = max(a.mask_B_T.shape[1], b.mask_B_T.shape[1])
    pad_a, pad_b = width - a.mask_B_T.shape[1], width - b.mask_B_T.shape[1]
    for x, y in zip(la, lb, strict=True):
        x.keys = torch.cat([_left_pad(x.keys, pad_a, 2), _left_pad(y.keys, pad_b, 2)], dim=0)
        x.values = torch.cat([_left_pad(x.values, pad_a, 2), _left_pad(y.values, pad_b, 2)], dim=0)
    mask = torch.cat([_left_pad(a.mask_B_T, pad_a, 1), _left_pad(b.mask_B_T, pad_b, 1)], dim=0)
    return BatchKV(cache=a.cache, mask_B_T=mask, next_pos_B=torch.cat([a.next_pos_B, b.next_pos_B]))


def keep_rows(kv: BatchKV, keep: list[int]) -> BatchKV | None:
    """Only the rows `keep` (in that order), trimmed of all-padding columns; None if no row left."""
    if not keep:
        return None
    idx = torch.tensor(keep, dtype=torch.long, device=kv.mask_B_T.device)
    mask = kv.mask_B_T.index_select(0, idx)
    first_real = int((mask.sum(dim=0) > 0).nonzero()[0, 0])
    for layer in _layers(kv.cache):
        layer.keys = layer.keys.index_select(0, idx)[:, :, first_real:]
        layer.values = layer.values.index_select(0, idx)[:, :, first_real:]
    return BatchKV(
        cache=kv.cache, mask_B_T=mask[:, first_real:], next_pos_B=kv.next_pos_B.index_select(0, idx)
    )
