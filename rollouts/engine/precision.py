"""The engine computing what a trainer under `torch.autocast` computes (`--autocast bfloat16`).

A trainer with `training.autocast = "bfloat16"` keeps fp32 weights and runs its forward under
autocast: every linear layer (and the LM head) multiplies in bf16, while the embeddings, the
RMSNorms, RoPE and the residual stream stay fp32. An engine serving bf16 weights computes a
different function: its residual stream and norms are bf16 too (on SmolLM2-135M its greedy
answers differ from the trainer's, and single-token logprobs by up to 1.2). This mode serves the
trainer's function at about a bf16 engine's speed:

- the weights of the linear layers are held in the autocast dtype (autocast would cast them
  to it at every call: the same values, without the per-step cast), all other weights fp32;
- a tied LM head gets a copy of its own in that dtype, refreshed from the embedding after every
  weight change (`refresh`, called by `EngineCore.weights_changed`, in place: a CUDA graph's
  addresses stay valid);
- every forward runs under `torch.autocast` (`context`), and the KV cache is held in the
  autocast dtype (`cache_dtype`: autocast rounds keys and values to it at the attention matmul
  anyway).

With the same weights, the engine's logprobs of a prompt equal the trainer's autocast forward's
to float rounding (`tests/engine/test_precision.py`).
"""

from __future__ import annotations

import contextlib
import typing
from typing import Any

import torch

from rollouts.config.engine_options import EngineAutocast

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
assert set(AUTOCAST_DTYPES) == set(typing.get_args(EngineAutocast)) - {"off", "auto"}, (
    f"{sorted(AUTOCAST_DTYPES)=} != the options' {typing.get_args(EngineAutocast)}"
)
_ATTR = "_rollouts_autocast"  # the autocast dtype, set on the model by `mix`


def mix(model: Any, autocast: str) -> None:
    """Put `model` (fp32, loaded) into the mixed precision of a trainer under `autocast`:
    linear weights (and biases) in that dtype, the rest fp32, a tied LM head untied into a copy
    in that dtype. A no-op for "off", and for "auto": a run resolves it for the engines it
    starts (config/auto.py); a standalone server has no trainer to follow."""
    if autocast in ("off", "auto"):
        return
    dtype = AUTOCAST_DTYPES[autocast]
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in params), "autocast needs an fp32 model (--dtype)"
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.data = module.weight.data.to(dtype)
                if module.bias is not None:
                    module.bias.data = module.bias.data.to(dtype)
        if head is not None:
            own = head.weight.detach().to(dtype).clone()
            head.weight = torch.nn.Parameter(own, requires_grad=False)
            if head.bias is not None:
                head.bias = torch.nn.Parameter(head.bias.detach().to(dtype), requires_grad=False)
    setattr(model, _ATTR, dtype)
    model._rollouts_tied_head = tied


def autocast_dtype(model: Any) -> torch.dtype | None:
    """The autocast dtype `model` was mixed for (None: it runs in its weights' dtype)."""
    return getattr(model, _ATTR, None)


def context(model: Any) -> contextlib.AbstractContextManager:
    """`torch.autocast` in the model's autocast dtype, or nothing."""
    dtype = autocast_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype)


def cache_dtype(model: Any, prefilled: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the autocast dtype, else the dtype the prefill produced."""
    return autocast_dtype(model) or prefilled


@torch.no_grad()
def refresh(model: Any) -> None:
    """After a weight change: the untied LM head copy takes the embedding's values again (in
    place). A no-op for a model not mixed or whose head was never tied."""
    if autocast_dtype(model) is None or not getattr(model, "_rollouts_tied_head", False):
        return
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.device != embedding.weight.device or not head.weight.numel():
        return  # asleep: both come back together, the copy with its values
    head.weight.copy_(embedding.weight)
