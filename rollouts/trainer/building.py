"""The pieces every backend is built from: device, HF model and tokenizer, AdamW, LR schedule.

Plain functions over torch objects and the Config, shared by `factories.create_pytorch_backend`
and `fsdp.create_fsdp_backend` (both import this module; neither imports the other at load
time). With `algorithm.advantage = "gae"` the RL backend also gets a critic: a zero-initialised
value head on the policy's last hidden state (`model.make_value_head`), in the same optimizer
(its own lr `algorithm.gae.value_lr`).
"""

from __future__ import annotations

import fnmatch
import math
import shutil
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rollouts.algorithms.advantages import needs_critic
from rollouts.config import Config, ModelConfig, OptimConfig, Scheduler
from rollouts.config.auto import (
    attention,
    engine_dtype,
    micro_batch_layout,
    micro_batch_tokens,
    trainer_autocasts,
)
from rollouts.config.model import ModelDtype
from rollouts.engine_kinds import engine_kind
from rollouts.trainer.core import BackendSettings


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; "cuda" without a GPU is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device = 'cuda' but no GPU is visible; use 'cpu' or 'auto'")
    return torch.device(name)


def load_hf_model(
    path: str | Path, model: ModelConfig, device: torch.device | None = None
) -> torch.nn.Module:
    """An HF causal LM ready to train, as [model] says: its dtype and attention, use_cache off,
    optional activation checkpointing and compiled decoder layers (`compile_decoder_layers`)."""
    from transformers import AutoModelForCausalLM

    dtype = model.dtype
    assert dtype in typing.get_args(ModelDtype), f"{dtype=} not in {typing.get_args(ModelDtype)}"
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path = {str(path)!r}: no config.json (not an HF model)")
    device_type = (device or torch.device("cpu")).type
    lm = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=getattr(torch, dtype),
        attn_implementation=attention(model.attn_implementation, device_type),
    )
    lm.config.use_cache = False
    if model.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if model.freeze:
        freeze_parameters(lm, model.freeze)
    if device is not None:
        lm.to(device)
    if model.compile:
        compile_decoder_layers(lm)
    return lm


def freeze_parameters(lm: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Each parameter that a `model.freeze` entry names stops training (requires_grad off);
    the names frozen (a tied weight's joined by " = "), also printed with their share of the
    model. A tied parameter matches under either of its names. An entry that names nothing, or
    freezing every parameter, raises with the names there are."""
    named = list(lm.named_parameters(remove_duplicate=False))
    frozen: dict[int, list[str]] = {}
    for pattern in patterns:
        hits = [(n, p) for n, p in named if _names(n, pattern)]
        if not hits:
            some = ", ".join(n for n, _ in named[:6])
            raise ValueError(
                f"model.freeze: {pattern!r} names no parameter of the model; give a dotted part "
                f"of a name (e.g. 'embed_tokens', 'layers.0') or a glob over names like {some}"
            )
        for _, p in hits:
            p.requires_grad_(False)
            frozen[id(p)] = [n for n, q in named if q is p]  # every name of a tied weight
    unique = {id(p): p for _, p in named}
    if all(not p.requires_grad for p in unique.values()):
        raise ValueError(f"model.freeze = {patterns!r} freezes every parameter: nothing to train")
    count = sum(unique[i].numel() for i in frozen)
    total = sum(p.numel() for p in unique.values())
    names = sorted(" = ".join(tied) for tied in frozen.values())
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    print(
        f"[model] freeze: {count / 1e6:.1f} M of {total / 1e6:.1f} M parameters stay as loaded "
        f"({shown})",
        flush=True,
    )
    return names


def _names(name: str, pattern: str) -> bool:
    """Whether `pattern` (a glob, or a run of whole dotted parts) names parameter `name`."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return f".{pattern}." in f".{name}."


def decoder_layers(lm: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of an HF decoder (`lm.get_decoder().layers`)."""
    get_decoder = getattr(lm, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"model.compile = true: {type(lm).__name__} has no decoder `.layers` to compile "
            "(get_decoder().layers); set model.compile = false for this model"
        )
    return layers


def compile_decoder_layers(lm: torch.nn.Module) -> int:
    """Replace each decoder layer's `forward` with a torch.compile'd one, in place.

    Per layer, like torchtitan and prime-rl: the layers share one graph (same code, same shapes),
    so the compile is paid once; elementwise work (norms, rotary, the gated MLP) fuses into a few
    kernels, which is most of the gain on a small model (measured 18-20% per train step on the
    CPU demo model). Only `forward` changes: parameter names, state dicts and HF saving are the
    same, and module hooks (FSDP2's all-gathers, activation checkpointing) stay eager around it.
    Shapes are dynamic, so micro-batches of every size reuse the compiled code.
    """
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++", "cc", "gcc")):
        raise RuntimeError(
            "model.compile = true: torch.compile (inductor) builds its kernels with a C/C++ "
            "compiler and none is on PATH (g++, c++, clang++, gcc, cc); install one (e.g. "
            "apt install g++) or set model.compile = false"
        )
    layers = decoder_layers(lm)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved with a model (written into every checkpoint)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def create_adamw_optimizer(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, lr: float | None = None
) -> torch.optim.AdamW:
    """AdamW from `[optim]` (`lr` overrides optim.lr, e.g. for SFT), with the fused kernel:
    - on CUDA, one launch for every parameter (PyTorch's default there is `foreach`, a launch per
      op and group): the same update, 8 ms of a 118 ms step of the ~0.4B model on an H200 with
      foreach;
    - on CPU for plain tensors (not FSDP's DTensors), one parallel pass (PyTorch's default there
      is a loop over the tensors): SmolLM2's 134.5 M fp32 parameters in 0.070 s against 0.322 s,
      weights within 6e-8 of the loop's after 3 steps (scripts/bench_adamw.py)."""
    trained = [p for p in params if p.requires_grad]
    fused = bool(trained) and all(_fusable(p) for p in trained)
    return torch.optim.AdamW(
        trained,
        lr=optim.lr if lr is None else lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=True if fused else None,
    )


def _fusable(p: torch.Tensor) -> bool:
    if not p.is_floating_point():
        return False
    return p.is_cuda or (p.device.type == "cpu" and type(p.data) is torch.Tensor)


def wants_value_head(config: Config, value_head: bool | None) -> bool:
    """An explicit choice, else a critic exactly when the advantage estimator needs one (GAE)."""
    return needs_critic(config.algorithm) if value_head is None else value_head


def create_optimizer_with_head(
    model_params: Iterable[torch.nn.Parameter],
    head: torch.nn.Module | None,
    config: Config,
    lr: float | None = None,
) -> torch.optim.AdamW:
    """AdamW over the model (lr or optim.lr) and, as a second group, the value head (value_lr)."""
    optimizer = create_adamw_optimizer(model_params, config.optim, lr)
    if head is not None:
        head_lr = config.algorithm.gae.value_lr or optimizer.param_groups[0]["lr"]
        optimizer.add_param_group({"params": list(head.parameters()), "lr": head_lr})
    return optimizer


def warmup_cosine_factor(
    step: int,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    kind: Scheduler = "cosine",
) -> float:
    """LR multiplier at `step`: linear warmup to 1, then cosine down to `min_lr_ratio`."""
    assert total_steps >= 1, f"{total_steps=}"
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def create_warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `warmup_cosine_factor` over `total_steps` optimizer steps."""
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        return warmup_cosine_factor(
            step, optim.warmup_steps, total, optim.min_lr_ratio, optim.scheduler
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def backend_settings(
    config: Config, device: torch.device, pad_id: int = 0, layout: str = "", hidden_size: int = 0
) -> BackendSettings:
    """BackendSettings from `[training]` and `[optim]` (bf16 autocast: `training.autocast`; the
    "auto" keys by config/auto.py's rules). `layout`: the micro-batch layout, when the caller
    chose it ("" = `training.micro_batch_layout`'s); `hidden_size`: the model's, which sizes an
    "auto" micro-batch."""
    t = config.training
    return BackendSettings(
        micro_batch_tokens=micro_batch_tokens(t.micro_batch_tokens, device.type, hidden_size),
        layout=layout or micro_batch_layout(config),
        logprob_chunk_size=t.logprob_chunk_size,
        max_grad_norm=config.optim.max_grad_norm,
        max_consecutive_nonfinite=t.max_consecutive_nonfinite,
        autocast_dtype=torch.bfloat16 if trainer_autocasts(config, device.type) else None,
        engine_dtype=engine_weights_dtype(config),
        pad_id=pad_id,
        logprob_positions=t.logprob_positions,
    )


def engine_weights_dtype(config: Config) -> torch.dtype | None:
    """`weight_sync.dtype` as a torch dtype to cast the engines' weight files to (None: as
    trained). "auto": a built-in engine's 16-bit dtype; float32 and external engines: None."""
    name = config.weight_sync.dtype
    if name == "auto":
        here = engine_kind(config.engines.kind).started_here
        name = engine_dtype(config, config.engines.builtin) if here else "float32"
    return None if name == "float32" else getattr(torch, name)


def model_path_of(config: Config, model_path: str | Path | None) -> Path:
    path = Path(model_path or config.model.path)
    if not str(path) or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path = {str(path)!r}: not an HF model directory")
    return path
