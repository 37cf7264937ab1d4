"""FSDPBackend: the TrainingBackend with FSDP2 (`fully_shard`) under torchrun.

Every rank builds the same model, shards each decoder layer and the wrapper, and gets the WHOLE
batch; the backend picks each rank's sequences (balanced by tokens), keeps ranks in lock-step
(same number of micro-batches), multiplies the loss by the world size (the gradient reduce
averages) and sums metrics across ranks. gloo on CPU, nccl on GPU. Checkpoints: HF model files
gathered on rank 0, optimizer as a distributed (DCP) checkpoint, the critic's value head (if
any, a child of the root wrapper, outside `lm`) as `value_head.pt` written by rank 0.

LoRA (`[model.lora]`): every rank wraps the model with PEFT before sharding (the adapters drawn
from `run.seed`, so the ranks agree); only the adapters require grad and are in the optimizer.
FSDP2 shards frozen and trainable parameters of one layer together and reduce-scatters only the
gradients that exist. What leaves the trainer is gathered on rank 0 from the full state dict: the
adapter (PEFT's directory), the base, or the merged model; the base logprobs are computed on
every rank with the adapters off. A checkpoint holds `adapter/` (and `model/`, merged, when
`save_merged`) and the adapters' optimizer state (DCP), as the one-device backend's does.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from rollouts.config import Config
from rollouts.trainer import building as f
from rollouts.trainer import lora
from rollouts.trainer.core import TrainerCore
from rollouts.trainer.dist import DistCollective, init_distributed
from rollouts.trainer.hf_files import write_engine_files
from rollouts.trainer.model import VALUE_HEAD_FILE, TokenLogprobModel, make_value_head
from rollouts.trainer.protocol import Metrics
from rollouts.trainer.pytorch import (
    MODEL_DIR,
    engine_state_dict,
    load_hf_weights,
    load_value_head,
    save_hf,
)
from rollouts.types import LossFn, TrainBatch, TrainFuture

T = TypeVar("T")
PREFIX = "lm."  # the wrapper holds the HF model as `lm`
HEAD_PREFIX = "value_head."  # ... and the critic head (when there is one) as `value_head`


def shard_model(
    lm: torch.nn.Module, chunk_size: int, value_head: torch.nn.Module | None = None
) -> TokenLogprobModel:
    """fully_shard every decoder layer, then the wrapper (embeddings, norm, heads) as the root."""
    model = TokenLogprobModel(lm, chunk_size, value_head)
    layers = getattr(lm.get_decoder(), "layers", None)
    assert layers is not None, f"{type(lm).__name__}: decoder has no `layers` to shard"
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


class FSDPBackend:
    """A model sharded over the torchrun ranks; see `TrainingBackend`."""

    def __init__(
        self, *, core: TrainerCore, tokenizer: Any = None, save_merged: bool = False
    ) -> None:
        assert isinstance(core.collective, DistCollective), f"{core.collective=}: not the ranks'"
        self.core = core
        self.model = core.model  # sharded (`shard_model`)
        self.hf = lora.hf_model(self.model.lm)  # the HF model: config, embeddings, save_pretrained
        self.adapters = lora.is_lora(self.model.lm)  # LoRA: `model.lm` is a PEFT model
        self.save_merged = save_merged  # LoRA: checkpoints also hold the merged model/
        self.tokenizer = tokenizer
        self.rank = core.collective.rank
        self.world_size = core.collective.world_size
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")

    def _submit(self, fn: Callable[..., T], *args: Any) -> TrainFuture[T]:
        return TrainFuture(self._executor.submit(contextvars.copy_context().run, fn, *args))

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False
    ) -> TrainFuture[Metrics]:
        """Every rank passes the whole batch; each trains its share; metrics summed over ranks."""
        return self._submit(self.core.forward_backward, batch, loss_fn, entropy)

    def optim_step(self) -> TrainFuture[Metrics]:
        """Clip the (global) gradient norm, step AdamW and the schedule, or skip if non-finite."""
        return self._submit(self.core.optim_step)

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Logprobs of the whole batch on every rank (each computes its share, then gathers)."""
        return self._submit(self.core.compute_logprobs, batch)

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Critic values of the whole batch on every rank, aligned like the logprobs."""
        return self._submit(self.core.compute_values, batch)

    @property
    def has_value_head(self) -> bool:
        return self.model.value_head is not None

    def _full_states(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(HF state dict of `lm`, state dict of the value head), full, on CPU (rank 0)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self.model, options=options)
        lm = {k.removeprefix(PREFIX): v for k, v in sd.items() if k.startswith(PREFIX)}
        head = {k.removeprefix(HEAD_PREFIX): v for k, v in sd.items() if k.startswith(HEAD_PREFIX)}
        return lm, head

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The HF state dict on rank 0 ({} elsewhere); with LoRA, base + adapter merged."""
        state = self._full_states()[0]
        if not self.adapters or self.rank != 0:
            return state
        return lora.merged_weights(lora.hf_names(state), lora.lora_scalings(self.model.lm))

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full HF state dict on CPU on rank 0 ({} elsewhere); every rank must call."""
        return self._submit(self._full_state).result()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Every rank passes the full HF state dict; each keeps its shard."""
        self._submit(self._load_weights, weights).result()

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.adapters:
            raise NotImplementedError(
                "load_weights of a LoRA backend: its weights are a frozen base and an adapter "
                "(load_checkpoint restores the adapter); a full state dict has no place here"
            )
        full = {PREFIX + k: v for k, v in weights.items()}
        options = StateDictOptions(full_state_dict=True, strict=not self.has_value_head)
        set_model_state_dict(self.model, full, options=options)

    def _load_head(self, head: Mapping[str, torch.Tensor]) -> None:
        full = {HEAD_PREFIX + k: v for k, v in head.items()}
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, full, options=options)

    def _save_hf(
        self, path: Path, for_engine: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        self._write_hf(path, self._full_state(), for_engine, dtype)

    def _write_hf(
        self,
        path: Path,
        state: dict[str, torch.Tensor],
        for_engine: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Rank 0 writes the gathered HF `state` as model files (for an engine: a tied head
        written out, floating tensors in `dtype`); every rank waits for it."""
        if self.rank == 0 and for_engine:
            write_engine_files(
                self.hf, self.tokenizer, path, engine_state_dict(self.hf, state), dtype
            )
        elif self.rank == 0:
            save_hf(self.hf, self.tokenizer, path, state)
        dist.barrier()

    def save_weights(self, path: Path) -> TrainFuture[None]:
        """HF files gathered and written by rank 0 (a tied LM head written out, as engines
        reload in place); every rank must call."""
        return self._submit(self._save_hf, Path(path), True, self.core.settings.engine_dtype)

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        """HF model (rank 0), optimizer (DCP, every rank), scheduler and counters (rank 0)."""
        return self._submit(self._save_checkpoint, Path(path))

    def _save_checkpoint(self, path: Path) -> None:
        if not self.adapters:
            self._save_hf(path / MODEL_DIR)
        else:
            self._save_adapter(path / lora.ADAPTER_DIR)
            if self.save_merged:
                self._save_hf(path / MODEL_DIR, for_engine=True)
        if self.has_value_head:
            head = self._full_states()[1]
            if self.rank == 0:
                torch.save(head, path / VALUE_HEAD_FILE)
        optim = get_optimizer_state_dict(self.model, self.core.optimizer)
        dcp.save({"optim": optim}, checkpoint_id=str(path / "optimizer"))
        if self.rank == 0:
            torch.save(self.core.scheduler.state_dict(), path / "scheduler.pt")
            (path / "backend.json").write_text(json.dumps(self.core.state_dict()))
        dist.barrier()

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        """Restore what `save_checkpoint` wrote (the world size may differ)."""
        return self._submit(self._load_checkpoint, Path(path))

    def _load_checkpoint(self, path: Path) -> None:
        if self.adapters:
            self._load_adapter(path / lora.ADAPTER_DIR)
        else:
            self._load_weights(load_hf_weights(path / MODEL_DIR))
        if self.has_value_head:
            self._load_head(load_value_head(path, torch.device("cpu")))
        state = {"optim": get_optimizer_state_dict(self.model, self.core.optimizer)}
        dcp.load(state, checkpoint_id=str(path / "optimizer"))
        set_optimizer_state_dict(self.model, self.core.optimizer, state["optim"])
        self.core.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        self.core.load_state_dict(json.loads((path / "backend.json").read_text()))

    def weight_snapshots(self) -> None:
        """No snapshots: weights are gathered and written when published."""
        return None

    def lora_adapters(self) -> FSDPBackend | None:
        """This backend when it trains LoRA adapters (`save_adapter`, base logprobs)."""
        return self if self.adapters else None

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        """The adapter's PEFT directory in `path`, gathered and written by rank 0 (in order
        after the submitted work); its size in bytes (0 on other ranks). Every rank calls."""
        assert self.adapters, "save_adapter of a backend without LoRA"
        return self._submit(self._save_adapter, Path(path))

    def _save_adapter(self, path: Path) -> int:
        state, size = self._full_states()[0], 0
        if self.rank == 0:
            size = lora.save_adapter(self.model.lm, self.tokenizer, path, state)
        dist.barrier()
        return size

    def _load_adapter(self, path: Path) -> None:
        """Every rank reads the adapter files and keeps its shard of each tensor."""
        full = {PREFIX + k: v for k, v in lora.adapter_param_names(lora.read_adapter(path)).items()}
        wanted = {PREFIX + n for n, p in self.model.lm.named_parameters() if p.requires_grad}
        if full.keys() != wanted:
            missing, unexpected = sorted(wanted - full.keys()), sorted(full.keys() - wanted)
            raise KeyError(f"{path}: adapter does not fit the model: {missing=} {unexpected=}")
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, full, options=options)

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        """The frozen base model as engine weight files in `path` (rank 0; a tied head written
        out); every rank calls."""
        assert self.adapters, "save_base_weights of a backend without LoRA"

        def work() -> None:
            state = self._full_states()[0]
            base = lora.base_weights(lora.hf_names(state)) if self.rank == 0 else {}
            self._write_hf(Path(path), base, for_engine=True)

        return self._submit(work)

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        """Logprobs of the base model (the adapters off) of the whole batch on every rank."""
        assert self.adapters, "compute_base_logprobs of a backend without LoRA"

        def work() -> tuple[torch.Tensor, ...]:
            with lora.base_model_off(self.model.lm):
                return self.core.compute_logprobs(batch)

        return self._submit(work)

    def pin_thread(self, cores: Collection[int]) -> None:
        """Nothing to pin: torchrun places the ranks."""
        return None

    def barrier(self) -> None:
        """Wait for every rank."""
        dist.barrier()

    def release(self) -> None:
        """Finish queued work and stop the worker thread; stay in the process group (so another
        backend, e.g. RL after SFT or a reference model, can be built in the same run)."""
        self._executor.shutdown(wait=True)

    def close(self) -> None:
        """Finish queued work, then leave the process group (after a barrier)."""
        self.release()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def create_fsdp_backend(
    config: Config,
    *,
    model_path: str | Path | None = None,
    total_steps: int | None = None,
    lr: float | None = None,
    value_head: bool | None = None,
) -> FSDPBackend:
    """An FSDP2 backend for `config`; call on every torchrun rank (value_head: see pytorch)."""
    device = init_distributed()
    path = f.model_path_of(config, model_path)
    m = config.model
    lm = f.load_hf_model(path, m, device)
    head = make_value_head(lm) if f.wants_value_head(config, value_head) else None
    if m.lora.enabled:  # before sharding; the same adapters on every rank (run.seed)
        lm = lora.apply_lora(lm, m.lora, seed=config.run.seed)
    model = shard_model(lm, config.training.logprob_chunk_size, head)
    tokenizer = f.load_tokenizer(m.tokenizer_path or path)
    optimizer = f.create_optimizer_with_head(model.lm.parameters(), model.value_head, config, lr)
    steps = config.training.rl_steps if total_steps is None else total_steps
    scheduler = f.create_warmup_cosine_scheduler(optimizer, config.optim, steps)
    core = TrainerCore(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        settings=f.backend_settings(
            config,
            device,
            tokenizer.pad_token_id or 0,
            hidden_size=int(getattr(lm.config, "hidden_size", 0) or 0),
        ),
        device=device,
        collective=DistCollective(model),
    )
    return FSDPBackend(core=core, tokenizer=tokenizer, save_merged=m.lora.save_merged)
