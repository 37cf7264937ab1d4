"""Loading HF-format safetensors weights into a running model (in place)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class WeightLoadError(ValueError):
    """The weights at a path cannot be loaded into this model (message says why)."""


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `path` (sharded checkpoints included).
    The tensors map the files: copy them before keeping them (a weight sync rewrites a
    version's files in place two versions later, weights/files.py `_recycle`)."""
    root = Path(path)
    if not root.is_dir():
        raise WeightLoadError(f"model_path {str(root)!r}: not a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"model_path {str(root)!r}: no *.safetensors file in it")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:  # corrupt, truncated, unreadable
            raise WeightLoadError(f"model_path {str(root)!r}: cannot read {f.name}: {exc}") from exc
    return tensors


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the checkpoint's tensors into `model`'s parameters; every parameter must be present."""
    tensors = read_safetensors_dir(path)
    own = model.state_dict()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise WeightLoadError(
            f"model_path {str(path)!r}: does not match the served model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, tensor in tensors.items():
        if own[name].shape != tensor.shape:
            raise WeightLoadError(
                f"model_path {str(path)!r}: {name} has shape {tuple(tensor.shape)}, "
                f"the served model has {tuple(own[name].shape)}"
            )
    for name, tensor in tensors.items():
        own[name].copy_(tensor.to(own[name].dtype))
