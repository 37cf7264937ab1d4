"""The training step shared by the single-device and FSDP backends (runs on the worker thread).

`TrainerCore` owns the wrapped model, optimizer and schedule, and does micro-batching, gradient
accumulation, clipping, the non-finite guard and metrics. What differs between one device and
several ranks (which sequences are local, how sums are reduced, how many micro-batches every
rank must run, how logprobs are gathered and the gradient norm clipped) goes through a small
`Collective`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from rollouts import tracing
from rollouts.config.training import LogprobPositions, MicroBatchLayout
from rollouts.trainer.batching import (
    LAYOUTS,
    MicroBatchPlan,
    MicroBatchTensors,
    build_tensors,
    plan_micro_batches,
)
from rollouts.trainer.model import TokenLogprobModel, move_to, split_per_sequence
from rollouts.trainer.prefix_plan import plan_shared_prefixes
from rollouts.trainer.protocol import Metrics, NonFiniteError
from rollouts.types import ARGMAX_MATCH, FULL_PRECISION, LossFn, ModelOutputs, TrainBatch

LOGPROB_POSITIONS = typing.get_args(LogprobPositions)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BackendSettings:
    """How a backend batches and steps (from `[training]` and `[optim]`)."""

    micro_batch_tokens: int = 4096
    layout: MicroBatchLayout = "pad"
    logprob_chunk_size: int = 0  # 0 = auto (by vocabulary, model.auto_chunk_size)
    max_grad_norm: float = 1.0
    max_consecutive_nonfinite: int = 3
    autocast_dtype: torch.dtype | None = None  # bf16 autocast on GPU; None = off
    # the weight files for engines in this dtype (cast on the device, before the host copy);
    # None = as trained (weight_sync.dtype)
    engine_dtype: torch.dtype | None = None
    pad_id: int = 0
    # "trained": the LM head runs only where loss_mask != 0 (other logprobs are 0); "all": all
    logprob_positions: LogprobPositions = "trained"

    def __post_init__(self) -> None:
        assert self.layout in LAYOUTS, f"{self.layout=} not in {LAYOUTS}"
        assert self.logprob_positions in LOGPROB_POSITIONS, f"{self.logprob_positions=}"
        assert self.micro_batch_tokens >= 1, f"{self.micro_batch_tokens=}"
        assert self.max_consecutive_nonfinite >= 1, f"{self.max_consecutive_nonfinite=}"


class Collective(Protocol):
    """What the core needs from the process group (trivial on one device)."""

    rank: int
    world_size: int

    def local_indices(self, lengths: Sequence[int]) -> list[int]: ...
    def sum(self, values: dict[str, float]) -> dict[str, float]: ...
    def max_int(self, value: int) -> int: ...
    def set_grad_sync(self, enabled: bool) -> None: ...
    def gather(
        self, out: dict[int, torch.Tensor], lengths: list[int]
    ) -> tuple[torch.Tensor, ...]: ...
    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor: ...


class LocalCollective:
    """One process: every sequence is local and every reduction is the identity."""

    rank = 0
    world_size = 1

    def local_indices(self, lengths: Sequence[int]) -> list[int]:
        return list(range(len(lengths)))

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def max_int(self, value: int) -> int:
        return value

    def set_grad_sync(self, enabled: bool) -> None:
        return None

    def gather(self, out: dict[int, torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        """Every sequence was computed here: in order."""
        assert len(out) == len(lengths), f"{len(out)=} != {len(lengths)=}"
        return tuple(out[i] for i in range(len(lengths)))

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to `max_norm`; their norm before."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class TrainerCore:
    """Micro-batched forward/backward, optimizer step and logprobs for one (wrapped) model."""

    def __init__(
        self,
        *,
        model: TokenLogprobModel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        settings: BackendSettings,
        device: torch.device,
        collective: Collective,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.settings = settings
        self.device = device
        self.collective = collective
        self.steps_taken = 0  # optimizer steps applied
        self.steps_skipped = 0  # steps skipped for a non-finite loss or gradient
        self.consecutive_nonfinite = 0
        self._pending_nonfinite = False  # a micro-batch loss since the last step was not finite
        self._full_precision = False  # this logprob pass runs without autocast

    def state_dict(self) -> dict[str, int]:
        return {
            "steps_taken": self.steps_taken,
            "steps_skipped": self.steps_skipped,
            "consecutive_nonfinite": self.consecutive_nonfinite,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps_taken = int(state["steps_taken"])
        self.steps_skipped = int(state["steps_skipped"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.settings.autocast_dtype
        if dtype is None or self._full_precision:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _plans(self, batch: TrainBatch) -> tuple[TrainBatch, list[MicroBatchPlan]]:
        lengths = [int(x.shape[0]) for x in batch.input_ids]
        local = batch.select(self.collective.local_indices(lengths))
        s = self.settings
        if s.layout == "prefix":
            plans = plan_shared_prefixes(local.input_ids, local.loss_mask, s.micro_batch_tokens)
            return local, plans
        local_lengths = [int(x.shape[0]) for x in local.input_ids]
        return local, plan_micro_batches(local_lengths, s.micro_batch_tokens, s.layout)

    def _run(
        self,
        mb: MicroBatchTensors,
        want_entropy: bool,
        want_values: bool = False,
        entropy_grad: bool = True,
        argmax_match: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence: logprobs, entropies, values, and the logprobs of `mb.top_ids` ([T_i, K],
        top-k distillation; empty without them)."""
        with self._autocast():
            lp_N, ent_N, val_N, top_N_K = self.model(
                move_to(mb, self.device),
                want_entropy,
                want_values,
                entropy_grad,
                argmax_match=argmax_match,
            )
        lps = split_per_sequence(lp_N, mb.split_sizes)
        ents = split_per_sequence(ent_N, mb.split_sizes) if want_entropy else []
        vals = split_per_sequence(val_N, mb.split_sizes) if want_values else []
        tops = split_per_sequence(top_N_K, mb.split_sizes) if mb.top_ids is not None else []
        return lps, ents, vals, tops

    def _tensors(
        self, plan: MicroBatchPlan, batch: TrainBatch, *, top: bool = True
    ) -> MicroBatchTensors:
        """One planned micro-batch of `batch`; the LM head skips untrained targets unless
        `logprob_positions = "all"`; with `top`, it also scores the teacher's top-k tokens
        where the batch has them (top-k distillation)."""
        trained_only = self.settings.logprob_positions == "trained"
        mask = batch.loss_mask if trained_only else None
        top_ids = batch.teacher_top_ids if top else ()
        return build_tensors(plan, batch.input_ids, self.settings.pad_id, mask, top_ids)

    def _filler_micro_batch(self) -> MicroBatchTensors:
        """A 2-token micro-batch for a rank that has run out of real ones (FSDP lock-step)."""
        ids = (torch.full((2,), self.settings.pad_id, dtype=torch.long),)
        plan = plan_micro_batches([2], 2, "pad")[0]
        return build_tensors(plan, ids, self.settings.pad_id)

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn, want_entropy: bool) -> Metrics:
        """Sum gradients of `loss_fn` over micro-batches; metrics summed over them and ranks.

        Values (the critic head) are computed when `loss_fn.needs_values`.
        """
        want_values = loss_fn.needs_values
        # an entropy the loss does not train on is a metric: no graph through [N, V] for it
        entropy_grad = loss_fn.needs_entropy
        t0 = time.perf_counter()
        self.model.train()
        local, plans = self._plans(batch)
        num_mb = self.collective.max_int(len(plans))
        sums: dict[str, float] = {}
        lengths = [int(x.shape[0]) for x in local.input_ids]
        real_tokens = sum(lengths)
        computed_tokens = sum(p.computed_tokens(lengths) for p in plans)
        padded_tokens = sum(p.padded_tokens for p in plans)
        nonfinite = 0.0
        for k in range(num_mb):
            self.collective.set_grad_sync(k == num_mb - 1)
            if k >= len(plans):  # the same parameters get (zero) gradients on every rank
                lps, _, vals, _ = self._run(self._filler_micro_batch(), False, want_values)
                (sum(t.sum() for t in lps + vals) * 0.0).backward()
                continue
            plan = plans[k]
            mb = self._tensors(plan, local)
            with tracing.span(
                "trainer", "forward", micro_batch=k, tokens=plan.computed_tokens(lengths)
            ):
                lps, ents, vals, tops = self._run(mb, want_entropy, want_values, entropy_grad)
                outputs = ModelOutputs(
                    logprobs=tuple(lps),
                    entropy=tuple(ents),
                    values=tuple(vals),
                    top_logprobs=tuple(tops),
                )
                # the loss reads the batch's tensors beside the outputs: on the model's device
                loss, metrics = loss_fn(outputs, local.select(plan.indices).to(self.device))
            assert loss.dim() == 0, f"loss_fn must return a scalar, got {tuple(loss.shape)=}"
            if not torch.isfinite(loss.detach()).item():
                nonfinite += 1.0
            with tracing.span("trainer", "backward", micro_batch=k):
                (loss * self.collective.world_size).backward()
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        tokens = (real_tokens, computed_tokens, padded_tokens)
        return self._fb_metrics(sums, nonfinite, tokens, num_mb, t0)

    def _fb_metrics(
        self,
        sums: dict[str, float],
        nonfinite: float,
        tokens: tuple[int, int, int],
        num_mb: int,
        t0: float,
    ) -> Metrics:
        """The summed metrics; `tokens`: (in the sequences, computed, computed slots with
        padding): a shared prefix ("prefix" layout) is computed once for its sequences."""
        keys = ("_nonfinite", "_real", "_computed", "_padded")
        extra = dict(zip(keys, (nonfinite, *map(float, tokens)), strict=True))
        out = self.collective.sum({**sums, **extra})
        nonfinite_all, real_all, computed_all, padded_all = (out.pop(k) for k in keys)
        self._pending_nonfinite = self._pending_nonfinite or nonfinite_all > 0
        out["nonfinite_micro_batches"] = nonfinite_all
        out["num_tokens"] = real_all
        out["computed_tokens"] = computed_all  # < num_tokens where prefixes are shared
        out["padding_fraction"] = 0.0 if padded_all == 0 else 1.0 - computed_all / padded_all
        out["num_micro_batches"] = float(num_mb)
        out["fwd_bwd_s"] = time.perf_counter() - t0
        return out

    def optim_step(self) -> Metrics:
        """Clip the (global) gradient norm to `max_grad_norm` and step; skip (and count) the step
        when the loss or the gradient is not finite."""
        with tracing.span("trainer", "optimizer step"):
            return self._optim_step()

    def _optim_step(self) -> Metrics:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(self.collective.clip_grad_norm(params, self.settings.max_grad_norm))
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = self._pending_nonfinite or not math.isfinite(grad_norm)
        self._pending_nonfinite = False
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.steps_skipped += 1
            self.consecutive_nonfinite += 1
            limit = self.settings.max_consecutive_nonfinite
            if self.consecutive_nonfinite >= limit:
                raise NonFiniteError(
                    f"{self.consecutive_nonfinite} optimizer steps in a row had a NaN/inf loss or "
                    f"gradient (limit training.max_consecutive_nonfinite = {limit}); lower "
                    "optim.lr, check the loss function and the data, or resume from a checkpoint"
                )
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps_taken += 1
            self.consecutive_nonfinite = 0
        return {
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped": float(skipped),
            "steps_skipped_total": float(self.steps_skipped),
            "optim_steps": float(self.steps_taken),
        }

    def compute_logprobs(self, batch: TrainBatch) -> tuple[Any, ...]:
        """Logprobs of every sequence (local ones computed here, then gathered across ranks)."""
        with tracing.span("trainer", "logprobs", sequences=len(batch.input_ids)):
            return self._per_token(batch, values=False)

    def compute_values(self, batch: TrainBatch) -> tuple[Any, ...]:
        """Critic values of every sequence, aligned like logprobs (`values[t]` = V(tokens < t))."""
        with tracing.span("trainer", "values", sequences=len(batch.input_ids)):
            return self._per_token(batch, values=True)

    @torch.no_grad()
    def _per_token(self, batch: TrainBatch, *, values: bool) -> tuple[Any, ...]:
        self.model.eval()
        # the weight sync's content probe: the master weights' own precision, no autocast
        self._full_precision = bool(batch.metadata.get(FULL_PRECISION))
        try:
            return self._per_token_of(batch, values=values)
        finally:
            self._full_precision = False

    def _per_token_of(self, batch: TrainBatch, *, values: bool) -> tuple[Any, ...]:
        lengths = [int(x.shape[0]) for x in batch.input_ids]
        local_idx = self.collective.local_indices(lengths)
        local, plans = self._plans(batch)
        num_mb = self.collective.max_int(len(plans))
        out: dict[int, torch.Tensor] = {}
        for k in range(num_mb):
            if k >= len(plans):
                self._run(self._filler_micro_batch(), False, values)
                continue
            mb = self._tensors(plans[k], local, top=False)
            argmax = bool(batch.metadata.get(ARGMAX_MATCH))  # 1.0/0.0 in place of logprobs
            lps, _, vals, _ = self._run(mb, False, values, argmax_match=argmax)
            for i, t in zip(plans[k].indices, vals if values else lps, strict=True):
                out[local_idx[i]] = t.float().cpu()
        return self.collective.gather(out, lengths)
