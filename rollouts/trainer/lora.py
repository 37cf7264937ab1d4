"""LoRA adapters on an HF causal LM (PEFT): wrap, save, load, merge, and switch off.

With `[model.lora]` the backend trains a `peft.PeftModel`: the base weights are frozen and only
the adapters (A and B of each target linear layer) get gradients and optimizer state. What the
rest of the project needs from it, and nothing more, lives here:

- `apply_lora`: wrap a loaded model (`get_peft_model`; "all-linear" = every linear layer of the
  decoder, never the LM head).
- `save_adapter` / `load_adapter`: a PEFT adapter directory (adapter_config.json +
  adapter_model.safetensors): what checkpoints keep and what vLLM and SGLang load by name.
- `merged_state_dict`: the full HF state dict with each adapter folded into its base weight
  (W + scaling * B @ A), computed beside the training model, which is never modified: what
  `weight_sync.lora = "merged"`, a merged checkpoint and `get_weights` give. It and
  `base_state_dict` are `merged_weights` / `base_weights` of the model's state dict: the FSDP
  backend applies those to the full state dict it gathers on rank 0.
- `base_model_off`: the base model's forward (the adapters switched off), the free reference.

PEFT is imported only here, and only when LoRA is on (the `lora` extra).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollouts.config.model import LoraConfig

ADAPTER_DIR = "adapter"  # a checkpoint's adapter (beside model/, the merged model on request)
ADAPTER_NAME = "default"  # PEFT's name of the one adapter a backend trains
PEFT_PREFIX = "base_model.model."  # a PeftModel's names = this + the wrapped HF model's


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            "model.lora.enabled = true needs PEFT: pip install 'peft>=0.17,<0.22' (the lora extra)"
        ) from e
    return peft


def linear_module_names(lm: nn.Module) -> list[str]:
    """ "all-linear" as module names: the last name part of every `nn.Linear` but the LM head
    (q_proj, ..., down_proj), the form every engine's adapter loader knows."""
    head = lm.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
    names -= {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if m is head}
    assert names, f"{type(lm).__name__} has no linear layer besides the LM head"
    return sorted(names)


def apply_lora(lm: nn.Module, lora: LoraConfig, seed: int = 0) -> nn.Module:
    """`lm` wrapped with fresh LoRA adapters (B = 0: the wrapped model computes what `lm` did;
    A drawn from `seed`, not from the global RNG); every base parameter is frozen."""
    assert lora.enabled, "apply_lora with model.lora.enabled = false"
    peft = _peft()
    targets = lora.target_modules
    if targets == "all-linear":
        targets = linear_module_names(lm)
    peft_config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[targets] if isinstance(targets, str) else list(targets),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(lm, peft_config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "LoRA matched no module: check model.lora.target_modules"
    assert all("lora_" in n for n in trainable), f"non-adapter parameters train: {trainable[:3]}"
    return model


def is_lora(lm: nn.Module) -> bool:
    """Whether `lm` is a PEFT model (without importing PEFT when it was never loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(lm, peft.PeftModel)


def hf_model(lm: nn.Module) -> nn.Module:
    """The HF model under `lm` (its config, embeddings, `save_pretrained`); `lm` itself when it
    has no adapters."""
    return lm.get_base_model() if is_lora(lm) else lm


def adapter_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names (no adapter name), CPU copies."""
    state = _peft().get_peft_model_state_dict(lm, adapter_name=ADAPTER_NAME)
    assert state, "the model has no adapter tensors"
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def save_adapter(
    lm: nn.Module,
    tokenizer: Any,
    path: Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Write the adapter directory `path` (PEFT's format, + the tokenizer); its size in bytes.
    `state_dict`: `lm`'s full state dict (PEFT names), for a sharded `lm` (FSDP)."""
    assert is_lora(lm), f"save_adapter of a model without adapters: {type(lm).__name__}"
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if state_dict is None else {"state_dict": dict(state_dict)}
    lm.save_pretrained(
        path, selected_adapters=[ADAPTER_NAME], save_embedding_layers=False, **kwargs
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    assert (path / "adapter_config.json").is_file(), f"no adapter_config.json in {path}"
    return sum(f.stat().st_size for f in path.glob("adapter_*"))


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of adapter directory `path` (PEFT's file names)."""
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no adapter weights (a LoRA checkpoint has adapter/)")
    return load_file(file)


def load_adapter(lm: nn.Module, path: Path) -> None:
    """Copy the adapter tensors of directory `path` into `lm`'s adapter (exactly)."""
    result = _peft().set_peft_model_state_dict(lm, read_adapter(path), adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise KeyError(f"{path}: adapter does not fit the model: {missing=} {unexpected=}")


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def lora_scalings(lm: nn.Module) -> dict[str, float]:
    """Adapted layer name (HF names) -> its scaling (alpha / r); read from the modules, so a
    sharded model gives it too."""
    layers = _lora_layers(hf_model(lm))
    assert layers, "lora_scalings of a model without LoRA layers"
    for name, layer in layers.items():
        assert not layer.fan_in_fan_out, f"{name}: fan_in_fan_out adapters are not supported"
    return {name: float(layer.scaling[ADAPTER_NAME]) for name, layer in layers.items()}


def hf_names(peft_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `PeftModel`'s state dict under the names of the HF model it wraps."""
    other = [k for k in peft_state if not k.startswith(PEFT_PREFIX)]
    assert not other, f"not a PeftModel's names: {other[:3]}"
    return {k.removeprefix(PEFT_PREFIX): v for k, v in peft_state.items()}


@torch.no_grad()
def base_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base model's HF state dict out of the adapted model's (HF names): no adapter
    tensors, `.base_layer.` dropped; CPU copies."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def merged_weights(
    state: Mapping[str, torch.Tensor], scalings: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """The HF state dict of base + adapter out of the adapted model's (HF names): each adapted
    layer's weight is W + scaling * B @ A (PEFT's delta, computed in float32); CPU copies."""
    out = base_weights(state)
    for name, scaling in scalings.items():
        weight = state[f"{name}.base_layer.weight"]
        a = state[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = state[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        delta = ((b @ a) * scaling).to(weight.dtype)
        out[f"{name}.weight"] = (weight.detach() + delta.to(weight.device)).to("cpu")
    return out


def base_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict of the frozen base model (CPU copies, HF names)."""
    return base_weights(hf_model(lm).state_dict())


def merged_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict of base + adapter (CPU copies, HF names); the training model is left
    as it is."""
    return merged_weights(hf_model(lm).state_dict(), lora_scalings(lm))


def adapter_param_names(file_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter file's tensors under the `PeftModel`'s parameter names (the adapter name put
    back: `...q_proj.lora_A.weight` -> `...q_proj.lora_A.default.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in file_state.items():
        head, sep, tail = key.rpartition(".lora_")
        part, dot, rest = tail.partition(".")
        assert sep and dot, f"not a LoRA adapter tensor: {key!r}"
        out[f"{head}.lora_{part}.{ADAPTER_NAME}.{rest}"] = value
    return out


@contextlib.contextmanager
def base_model_off(lm: nn.Module) -> Iterator[None]:
    """Within the block `lm` computes the base model (its adapters switched off)."""
    assert is_lora(lm), f"base_model_off of a model without adapters: {type(lm).__name__}"
    with lm.disable_adapter():
        yield
