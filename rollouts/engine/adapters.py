"""LoRA adapters in the built-in server: loaded by name, merged into the served weights.

The routes are vLLM's (`/v1/load_lora_adapter`, requests naming the adapter in `model`) and
SGLang's (`/load_lora_adapter`, `lora_path` in /generate); an adapter is a PEFT directory
(adapter_config.json + adapter_model.safetensors), read without PEFT: each adapted weight
`W` becomes `W + scaling * B @ A` (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).

One set of weights is served at a time: the adapter loaded last, merged into a copy of the base
weights (the base of each adapted tensor is kept, so a later adapter or an unload restores it
exactly). Every request gets the weights served now, whatever adapter or model it names, as
after a full reload (the version label says which); the OpenAI routes check no model name (as
before LoRA), /generate refuses a `lora_path` that is not loaded (as SGLang does). A full weight
reload drops every adapter.

A server in bf16 or fp16 merges from the base as its files hold it (fp32, say), read once from
the directory its weights were loaded from: `low(W + delta)`, not `low(low(W) + delta)`. The
second drops every delta under half a step of the low-precision grid at `low(W)` (a step is
2^-8 of |W| in bf16) and so serves a policy behind the trained one: in SmolLM2 LoRA RL on a
bf16 engine (configs/smollm2-lora-cpu.toml) the engine's logprobs of the sampled tokens were
0.043 a token from the trainer's (median over a run, 3 seeds), 0.020 with this merge, where an
fp32 engine's are 0.021.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from rollouts.engine.weights import WeightLoadError, read_safetensors_dir

PEFT_PREFIX = "base_model.model."  # PEFT's key prefix of a causal LM's adapter tensors


class AdapterError(ValueError):
    """An adapter name the server does not know, or one loaded twice."""


def _config(root: Path) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of adapter_config.json."""
    try:
        config = json.loads((root / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightLoadError(f"lora_path {str(root)!r}: no readable adapter_config.json") from exc
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise WeightLoadError(f"lora_path {str(root)!r}: only plain LoRA adapters are supported")
    if config.get("fan_in_fan_out"):
        raise WeightLoadError(f"lora_path {str(root)!r}: fan_in_fan_out adapters not supported")
    return int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora"))


def _pairs(tensors: dict[str, torch.Tensor], root: Path) -> dict[str, tuple[torch.Tensor, ...]]:
    """Module name -> (A [r, in], B [out, r]) from PEFT's `<prefix><module>.lora_A.weight`."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise WeightLoadError(f"lora_path {str(root)!r}: unexpected tensor {key!r}")
        pairs.setdefault(module, {})[part[0]] = tensor
    incomplete = [m for m, ab in pairs.items() if set(ab) != {"A", "B"}]
    if incomplete:
        raise WeightLoadError(f"lora_path {str(root)!r}: A or B missing for {incomplete[:3]}")
    return {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}


@torch.no_grad()
def read_adapter(path: str | Path, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight deltas of the PEFT adapter at `path` (weight name -> scaling * B @ A, in fp32
    on the weight's device: the merge rounds once, to the weight's dtype), checked against the
    served model's state dict `own`."""
    root = Path(path)
    r, alpha, rslora = _config(root)
    try:
        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightLoadError(f"lora_path {str(root)!r}: cannot read the adapter: {exc}") from exc
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    deltas: dict[str, torch.Tensor] = {}
    for module, (a, b) in _pairs(tensors, root).items():
        name = f"{module}.weight"
        if name not in own:
            raise WeightLoadError(f"lora_path {str(root)!r}: the model has no {name!r}")
        weight = own[name]
        delta = (b.float() @ a.float()) * scaling
        if tuple(delta.shape) != tuple(weight.shape):
            raise WeightLoadError(
                f"lora_path {str(root)!r}: {name} gets a {tuple(delta.shape)} update, the model "
                f"has {tuple(weight.shape)}"
            )
        deltas[name] = delta.to(device=weight.device)
    if not deltas:
        raise WeightLoadError(f"lora_path {str(root)!r}: the adapter has no tensors")
    return deltas


LOW_PRECISION = (torch.bfloat16, torch.float16)


class ServedAdapters:
    """The adapters a server has loaded (by name) and the one merged into its weights.
    `weights_path`: the directory the served weights were loaded from (its files' base is the
    precise one a low-precision server merges from), None when unknown."""

    def __init__(self, model: torch.nn.Module, weights_path: str | None = None) -> None:
        self.model = model
        self.loaded: dict[str, str] = {}  # name -> path, in load order
        self.active: str | None = None  # merged into the served weights
        self._base: dict[str, torch.Tensor] = {}  # the base of every tensor an adapter changed
        self._weights_path = weights_path
        self._stamp = _stamp(weights_path)  # the files as they were when loaded
        self._precise: dict[str, torch.Tensor] = {}  # their tensors, for a low-precision server
        self.precise_base = False  # the last merge was from the files' base

    def knows(self, name: str) -> bool:
        return name in self.loaded

    @torch.no_grad()
    def load(self, name: str, path: str) -> None:
        """Merge the adapter at `path` into the base weights and serve it as `name`; on an error
        nothing changes (the adapter is read and checked before any weight is touched)."""
        if name in self.loaded:
            raise AdapterError(f"the LoRA adapter {name!r} has already been loaded")
        own = self.model.state_dict()
        deltas = read_adapter(path, own)
        precise = self._precise_base(own, deltas)
        self._restore(own)
        for key, delta in deltas.items():
            self._base[key] = own[key].detach().clone()
            if key in precise:
                base = precise[key].to(device=delta.device, dtype=torch.float32)
                own[key].copy_(base + delta)
            else:
                own[key].add_(delta)
        self.precise_base = bool(precise)
        self.loaded[name] = str(path)
        self.active = name

    def _precise_base(
        self, own: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The files' base of the adapted tensors, where the server holds them in bf16/fp16 and
        the files in more precision (read once and kept in host memory); {} otherwise, or when
        the files changed since they were loaded (the merge is then in the served dtype)."""
        if not any(own[k].dtype in LOW_PRECISION for k in deltas) or self._weights_path is None:
            return {}
        missing = [k for k in deltas if k not in self._precise]
        if missing:
            if _stamp(self._weights_path) != self._stamp:
                return {}
            files = read_safetensors_dir(self._weights_path)
            for key in missing:
                if key in files and files[key].dtype.itemsize > own[key].dtype.itemsize:
                    self._precise[key] = files[key].clone()
                else:  # stored in the served precision (or absent): nothing more precise
                    self._precise[key] = own[key].detach().to("cpu", copy=True)
        return {k: self._precise[k] for k in deltas if self._precise[k].dtype != own[k].dtype}

    @torch.no_grad()
    def unload(self, name: str) -> None:
        """Forget adapter `name`; the base weights are served again if it was the merged one."""
        if name not in self.loaded:
            raise AdapterError(f"the LoRA adapter {name!r} cannot be found")
        del self.loaded[name]
        if self.active == name:
            self._restore(self.model.state_dict())
            self.active = None

    def reset(self, weights_path: str | None = None) -> None:
        """After a full weight reload (from `weights_path`, None if unknown) or a discard: the
        new weights are the base, no adapter is loaded."""
        self.loaded.clear()
        self._base.clear()
        self._precise.clear()
        self._weights_path, self._stamp = weights_path, _stamp(weights_path)
        self.active = None
        self.precise_base = False

    def _restore(self, own: dict[str, torch.Tensor]) -> None:
        for key, base in self._base.items():
            own[key].copy_(base)
        self._base.clear()


def _stamp(path: str | None) -> tuple | None:
    """(name, size, mtime) of each safetensors file in `path`: whether they changed since."""
    if path is None or not Path(path).is_dir():
        return None
    files = sorted(Path(path).glob("*.safetensors"))
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
