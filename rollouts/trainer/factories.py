"""Factories: build a backend from the Config (tier 1), or use the pieces alone.

The pieces (`load_hf_model`, `create_adamw_optimizer`, `create_warmup_cosine_scheduler`, ...)
live in `building.py` and are re-exported here; `create_pytorch_backend` wires them from
`[model]`, `[optim]` and `[training]`; `create_backend` picks the one-device or the FSDP2
backend (`fsdp.py`, imported only when asked for: it needs torch.distributed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollouts.config import Config
from rollouts.config.auto import micro_batch_layout
from rollouts.trainer.building import (
    backend_settings,
    create_adamw_optimizer,
    create_optimizer_with_head,
    create_warmup_cosine_scheduler,
    load_hf_model,
    load_tokenizer,
    model_path_of,
    resolve_device,
    wants_value_head,
    warmup_cosine_factor,
)
from rollouts.trainer.core import LocalCollective, TrainerCore
from rollouts.trainer.lora import apply_lora
from rollouts.trainer.model import TokenLogprobModel, make_value_head, shared_prefix_problem
from rollouts.trainer.pytorch import PyTorchBackend

__all__ = [
    "backend_settings",
    "create_adamw_optimizer",
    "create_backend",
    "create_optimizer_with_head",
    "create_pytorch_backend",
    "create_warmup_cosine_scheduler",
    "load_hf_model",
    "load_tokenizer",
    "model_path_of",
    "resolve_device",
    "wants_value_head",
    "warmup_cosine_factor",
]


def create_pytorch_backend(
    config: Config,
    *,
    model_path: str | Path | None = None,
    total_steps: int | None = None,
    lr: float | None = None,
    value_head: bool | None = None,
) -> PyTorchBackend:
    """A one-device backend for `config` (`model_path` overrides model.path).

    `value_head`: add the critic head (None = when algorithm.advantage is "gae").
    With `model.lora.enabled` the model is wrapped with LoRA adapters (`lora.apply_lora`) and
    the optimizer holds only theirs (and the critic head's) parameters.
    """
    path = model_path_of(config, model_path)
    device = resolve_device(config.training.device)
    m = config.model
    lm = load_hf_model(path, m, device)
    problem = shared_prefix_problem(lm)
    layout = micro_batch_layout(config)
    if layout == "prefix" and problem:
        if config.training.micro_batch_layout == "prefix":
            raise ValueError(
                f"training.micro_batch_layout = 'prefix' cannot train {path}: {problem}; set "
                "training.micro_batch_layout = 'pad'"
            )
        layout = "pad"  # "auto": the layout every model can train
    tokenizer = load_tokenizer(m.tokenizer_path or path)
    head = make_value_head(lm) if wants_value_head(config, value_head) else None
    if m.lora.enabled:  # only the adapters train: the optimizer holds only their state
        lm = apply_lora(lm, m.lora, seed=config.run.seed)
    optimizer = create_optimizer_with_head(lm.parameters(), head, config, lr)
    steps = config.training.rl_steps if total_steps is None else total_steps
    scheduler = create_warmup_cosine_scheduler(optimizer, config.optim, steps)
    pad_id = tokenizer.pad_token_id or 0
    hidden = int(getattr(lm.config, "hidden_size", 0) or 0)
    settings = backend_settings(config, device, pad_id, layout, hidden)
    core = TrainerCore(
        model=TokenLogprobModel(lm, settings.logprob_chunk_size, head),
        optimizer=optimizer,
        scheduler=scheduler,
        settings=settings,
        device=device,
        collective=LocalCollective(),
    )
    return PyTorchBackend(core=core, tokenizer=tokenizer, save_merged=m.lora.save_merged)


def create_backend(config: Config, **kwargs: Any) -> Any:
    """The backend `training.backend` names (fsdp must run under torchrun)."""
    if config.training.backend == "fsdp":
        from rollouts.trainer.fsdp import create_fsdp_backend

        return create_fsdp_backend(config, **kwargs)
    return create_pytorch_backend(config, **kwargs)
