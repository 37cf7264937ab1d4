"""PyTorchBackend: the TrainingBackend on one device (CPU or one GPU).

All model work runs on one worker thread (a single-thread executor), in submission order, and
comes back as a `TrainFuture`. Checkpoint files: `model/` (HF safetensors + config + tokenizer),
`optimizer.pt`, `scheduler.pt`, `backend.json`, and `value_head.pt` when the model has a critic
head (PPO with GAE): the head is outside `model/`, so engines always load a plain HF causal LM.
It also resumes a checkpoint of the FSDP backend (its optimizer is a DCP directory).

With LoRA (`lm` a PEFT model, `lora.py`) the checkpoint holds `adapter/` (PEFT's directory) and,
when `save_merged`, `model/` with the adapter merged in; the weights it gives (`get_weights`,
`save_weights`, snapshots) are always the merged full model, and `lora_adapters()` adds the
adapter's own files and the base model's logprobs (the adapters off: the free reference).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from rollouts import tracing
from rollouts.trainer import lora
from rollouts.trainer.core import LocalCollective, TrainerCore
from rollouts.trainer.hf_files import write_engine_files
from rollouts.trainer.model import VALUE_HEAD_FILE
from rollouts.trainer.protocol import Metrics
from rollouts.types import LossFn, TrainBatch, TrainFuture

T = TypeVar("T")
MODEL_DIR = "model"


def save_hf(lm: Any, tokenizer: Any, path: Path, state_dict: dict[str, Any] | None) -> None:
    """HF-format model files (+ tokenizer) that transformers, vLLM and SGLang load."""
    path.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    assert (path / "config.json").is_file(), f"save_pretrained wrote no config.json in {path}"


def engine_state_dict(lm: Any, state_dict: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state dict an engine reloads: every tensor the model has, a tied LM head included.

    `save_pretrained` leaves `lm_head.weight` out of the files when it shares the embedding's
    storage (loading a fresh model ties it again), but an in-place reload does not tie: vLLM's
    `reload_weights` then updated the embedding and kept the old LM head while reporting the new
    version. Here a tied head is its own entry (the embedding's tensor under the head's name:
    `write_engine_files` writes it out as a second copy)."""
    state = dict(state_dict) if state_dict is not None else dict(lm.state_dict())
    if not getattr(lm.config, "tie_word_embeddings", False) or lm.get_output_embeddings() is None:
        return state
    embedding = lm.get_input_embeddings().weight
    names = [n for n, p in lm.named_parameters(remove_duplicate=False) if p is embedding]
    head = next((n for n in names if n in state and "embed" not in n), "lm_head.weight")
    source = next(n for n in names if n in state and n != head)
    state[head] = state[source]
    return state


def load_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF safetensors files in `path` (sharded or not), on CPU, in memory of
    their own (`load_file` maps the file, and a weight sync's files are rewritten in place)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (not an HF model directory)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.clone() for k, v in load_file(f).items()})
    return weights


def load_value_head(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The critic head's weights saved in checkpoint `path` (an error naming the fix if absent)."""
    file = path / VALUE_HEAD_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: the backend has a value head (algorithm.advantage = 'gae') but the "
            "checkpoint has none (it was written without a critic); resume with the algorithm "
            "it was trained with, or start a new run"
        )
    return torch.load(file, map_location=device, weights_only=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, path: Path) -> None:
    """`optimizer.pt`'s state into `optimizer`, refused (naming the settings that decide what
    trains) when its parameters are not the ones this run trains: torch checks only the counts,
    and state of another shape would meet the gradients at the first step, or never."""
    saved = [len(g["params"]) for g in state.get("param_groups", [])]
    wanted = [len(g["params"]) for g in optimizer.param_groups]
    problem = f"it holds {saved} parameter tensors a group, this run trains {wanted}"
    if saved == wanted:
        optimizer.load_state_dict(state)
        shapes = [
            (tuple(v.shape), tuple(p.shape))
            for g in optimizer.param_groups
            for p in g["params"]
            for k, v in optimizer.state.get(p, {}).items()
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        bad = [(a, b) for a, b in shapes if a != b]
        if not bad:
            return
        problem = f"its state has shape {bad[0][0]} for a parameter of shape {bad[0][1]}"
    raise ValueError(
        f"{path}/optimizer.pt does not fit this run's trained parameters: {problem}. The "
        "checkpoint was written with other model.freeze, model.lora or critic settings; resume "
        "with the settings it was written with"
    )


def load_dcp_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> None:
    """Load an FSDP run's optimizer (a DCP checkpoint) into a one-process optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optim": get_optimizer_state_dict(model, optimizer)}  # the template, state made
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(model, optimizer, state["optim"])


class PyTorchBackend:
    """A model, AdamW and its schedule on one device; see `TrainingBackend`."""

    rank = 0
    world_size = 1

    def __init__(
        self, *, core: TrainerCore, tokenizer: Any = None, save_merged: bool = False
    ) -> None:
        assert isinstance(core.collective, LocalCollective), f"{core.collective=}: one device"
        self.core = core
        self.lm = core.model.lm  # an HF causal LM, or a PEFT model holding one (LoRA)
        self.hf = lora.hf_model(self.lm)  # the HF model: config, embeddings, save_pretrained
        self.adapters = lora.is_lora(self.lm)
        self.save_merged = save_merged  # LoRA: checkpoints also hold the merged model/
        self.tokenizer = tokenizer
        self.device = core.device
        self.value_head = core.model.value_head  # the critic (its params are in the optimizer)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")

    def pin_thread(self, cores: Collection[int]) -> None:
        """Run the training thread, and the torch threads it starts, on `cores` (Linux); call it
        before any other work (`training/placement.py`)."""
        self._submit(os.sched_setaffinity, 0, set(cores)).result()

    def _submit(self, fn: Callable[..., T], *args: Any) -> TrainFuture[T]:
        return TrainFuture(self._executor.submit(contextvars.copy_context().run, fn, *args))

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False
    ) -> TrainFuture[Metrics]:
        """Accumulate gradients of `loss_fn` over `batch`; see `TrainingBackend`."""
        return self._submit(self.core.forward_backward, batch, loss_fn, entropy)

    def optim_step(self) -> TrainFuture[Metrics]:
        """Clip to `max_grad_norm`, step AdamW and the schedule (or skip a non-finite step)."""
        return self._submit(self.core.optim_step)

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence logprobs under the current weights (no grad)."""
        return self._submit(self.core.compute_logprobs, batch)

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence critic values (no grad, CPU float32), aligned like the logprobs."""
        return self._submit(self.core.compute_values, batch)

    def copy_weights(self) -> TrainFuture[dict[str, torch.Tensor]]:
        """A CPU copy of the full HF state dict, taken on the training thread in order after
        the work submitted before it."""

        return self._submit(self._full_state_dict)

    def _full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of the HF state dict (with LoRA: base + adapter, merged); floating
        tensors cast to `dtype` when given (on the device, before the copy)."""

        def cast(v: torch.Tensor) -> torch.Tensor:
            return v.to(dtype) if dtype is not None and v.is_floating_point() else v

        if self.adapters:
            return {k: cast(v) for k, v in lora.merged_state_dict(self.lm).items()}
        return {k: cast(v.detach()).to("cpu", copy=True) for k, v in self.lm.state_dict().items()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the full HF state dict."""
        return self.copy_weights().result()

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """This step's weights for `write_weights`: a CPU copy in the engines' dtype."""
        return self._submit(self._full_state_dict, self.core.settings.engine_dtype).result()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy `weights` into the model in place (optimizer references stay valid)."""
        self._submit(self._load_weights, weights).result()

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.adapters:
            raise NotImplementedError(
                "load_weights of a LoRA backend: its weights are a frozen base and an adapter "
                "(load_checkpoint restores the adapter); a full state dict has no place here"
            )
        missing, unexpected = self.lm.load_state_dict(dict(weights), strict=False)
        tied = set(getattr(self.lm, "_tied_weights_keys", None) or {})
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise KeyError(f"load_weights: {missing=} {unexpected=} (a different model?)")

    def save_weights(self, path: Path) -> TrainFuture[None]:
        """HF safetensors + config + tokenizer in `path`, for engines to reload: written from
        the live parameters on the training thread (no copy of the model first)."""
        return self._submit(lambda: self._save_full(Path(path), self._live_state_dict()))

    def _live_state_dict(self) -> dict[str, torch.Tensor]:
        """The HF state dict as the engines get it: the parameters themselves (with LoRA: base
        + adapter, merged, which computes new tensors)."""
        return lora.merged_state_dict(self.lm) if self.adapters else self.lm.state_dict()

    def _save_full(self, path: Path, weights: Mapping[str, torch.Tensor]) -> None:
        dtype = self.core.settings.engine_dtype
        write_engine_files(
            self.hf, self.tokenizer, path, engine_state_dict(self.hf, weights), dtype
        )

    def write_weights(self, weights: Mapping[str, torch.Tensor], path: Path) -> None:
        """`save_weights` of a `snapshot_weights` copy, on the calling thread: the training thread
        goes on with the next step while the files are written (only the config and the
        tokenizer are read from the live model)."""
        self._save_full(Path(path), weights)

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        """Model, tokenizer, optimizer, scheduler and counters into directory `path`."""
        return self._submit(self._save_checkpoint, Path(path))

    def _save_checkpoint(self, path: Path) -> None:
        with tracing.span("trainer", "checkpoint write", path=path.name):
            self._write_checkpoint(path)

    def _write_checkpoint(self, path: Path) -> None:
        if self.adapters:
            lora.save_adapter(self.lm, self.tokenizer, path / lora.ADAPTER_DIR)
            if self.save_merged:
                self._save_full(path / MODEL_DIR, lora.merged_state_dict(self.lm))
        else:
            save_hf(self.lm, self.tokenizer, path / MODEL_DIR, None)
        torch.save(self.core.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(self.core.scheduler.state_dict(), path / "scheduler.pt")
        (path / "backend.json").write_text(json.dumps(self.core.state_dict()))
        if self.value_head is not None:
            torch.save(self.value_head.state_dict(), path / VALUE_HEAD_FILE)

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        """Restore model, optimizer, scheduler and counters from `path`."""
        return self._submit(self._load_checkpoint, Path(path))

    def _load_checkpoint(self, path: Path) -> None:
        if self.adapters:
            lora.load_adapter(self.lm, path / lora.ADAPTER_DIR)
        else:
            self._load_weights(load_hf_weights(path / MODEL_DIR))
        if self.value_head is not None:
            self.value_head.load_state_dict(load_value_head(path, self.device))
        self._load_optimizer(path)
        self.core.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        self.core.load_state_dict(json.loads((path / "backend.json").read_text()))

    def _load_optimizer(self, path: Path) -> None:
        """`optimizer.pt`, or the DCP `optimizer/` an FSDP run wrote (any world size: the
        parameter names are the same, so one process takes the whole state)."""
        if (path / "optimizer.pt").is_file():
            optim = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
            load_optimizer_state(self.core.optimizer, optim, path)
            return
        if not (path / "optimizer").is_dir():
            raise FileNotFoundError(
                f"{path}: no optimizer state (neither optimizer.pt of the one-process backend nor "
                "the optimizer/ DCP directory of the FSDP backend): not a training checkpoint?"
            )
        load_dcp_optimizer(self.core.model, self.core.optimizer, path / "optimizer")

    def weight_snapshots(self) -> PyTorchBackend:
        """This backend: it takes snapshots (`snapshot_weights`, `write_weights`)."""
        return self

    def lora_adapters(self) -> PyTorchBackend | None:
        """This backend when it trains LoRA adapters (`save_adapter`, base logprobs)."""
        return self if self.adapters else None

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        """The adapter's PEFT directory in `path` (in order after the submitted work); its
        size in bytes."""
        assert self.adapters, "save_adapter of a backend without LoRA"
        return self._submit(lora.save_adapter, self.lm, self.tokenizer, Path(path))

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        """The frozen base model as engine weight files in `path` (a tied head written out)."""
        assert self.adapters, "save_base_weights of a backend without LoRA"
        return self._submit(lambda: self._save_full(Path(path), lora.base_state_dict(self.lm)))

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Per-sequence logprobs of the base model: the same weights, the adapters off."""
        assert self.adapters, "compute_base_logprobs of a backend without LoRA"

        def work() -> tuple[torch.Tensor, ...]:
            with lora.base_model_off(self.lm):
                return self.core.compute_logprobs(batch)

        return self._submit(work)

    def barrier(self) -> None:
        """One device: nothing to wait for."""
        return None

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._executor.shutdown(wait=True)
