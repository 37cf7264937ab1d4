"""What the RL loop carries from batch to batch, and the pure rules over it.

A step is one trained batch (its optimizer updates): `step` counts them, and the policy version
moves with them. A batch that trains nothing (every group failed, was filtered out or was too
stale) is not a step: it is counted apart (`empty_batches`), reported on the next step's line
(`rollout/empty_batches`) and on the console, and `MAX_EMPTY_BATCHES` of them in a row stop the
run. Batches are numbered apart from steps (`batches`): the number names the batch's sampling
seeds and its DataBuffer state, and a checkpoint keeps it, so a resumed run numbers on.
Also here: the records the loop shares with its driver (`RLHooks` in, `RLResult` out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from rollouts.algorithms.kl import AdaptiveKL
from rollouts.types import RolloutBatch


class StepLog(Protocol):
    """Where a loop writes each step's metrics line (the driver's `MetricsLogger`)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...


MAX_EMPTY_BATCHES = 3  # batches in a row that train nothing before the run stops


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLHooks:
    """What the driver plugs into the loop (all async; each returns quickly or is bounded)."""

    # (step, version, buffer_state, *, metrics, loop_state): metrics = the step's (train + eval),
    # so the driver can keep the best checkpoint (`checkpoint.best_metric`); loop_state = the
    # loop's own JSON-safe state (e.g. the adaptive KL coefficient), given back on resume
    checkpoint: Callable[..., Awaitable[None]]
    evaluate: Callable[[int], Awaitable[dict[str, float]]] | None = None  # (step) -> metrics
    should_stop: Callable[[], bool] = lambda: False
    # (step, number, batch): every batch the loop takes, trained or not, with the step it
    # trains as and its number (failed samples, a short batch and sampled rows reported:
    # `driver/failures.py`)
    report_batch: Callable[[int, int, RolloutBatch], None] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLResult:
    """Where an RL run ended."""

    steps: int
    weight_version: str
    last_metrics: dict[str, float]


@dataclasses.dataclass(kw_only=True, slots=True)
class LoopState:
    """The loop's own state (mutable; only `run_rl_training` and its steps change it)."""

    version: int  # the policy version: one more per trained step
    synced: int  # the version the engines were last given
    step: int  # steps done (trained batches)
    batches: int  # batches done, trained or not (the next one is number batches + 1)
    step_batch: int  # the number of the batch the last step trained
    checkpointed: int  # the last step with a checkpoint
    kl_ctl: AdaptiveKL
    empty_batches: int = 0  # batches that trained nothing, in all
    empty_in_a_row: int = 0
    empty_since_step: int = 0  # reported (and reset) on the next step's line
    # FAILED samples by reason of the batches that trained nothing since the last step (they go
    # on the next step's line with its own: rollout/reward_failed/<reason>)
    failures_since_step: dict[str, int] = dataclasses.field(default_factory=dict)
    in_backend: bool = False  # training, or writing a checkpoint: no rescue from there
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last step's line
    step_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # for a rescue

    def __post_init__(self) -> None:
        assert self.step <= self.batches, f"{self.step=} > {self.batches=}"
        assert self.step_batch <= self.batches, f"{self.step_batch=} > {self.batches=}"

    def to_checkpoint(self) -> dict[str, Any]:
        """The JSON-safe part a checkpoint keeps (`from_checkpoint` reads it back)."""
        return {
            "kl_ctl": self.kl_ctl.state_dict(),
            "batch": self.step_batch,
            "empty_batches": self.empty_batches,
        }


def loop_state_from(
    saved: Mapping[str, Any] | None, kl_ctl: AdaptiveKL, step: int, version: int
) -> LoopState:
    """The state of a run that starts at `step` and `version` (0, 0: a new run), with what its
    checkpoint's loop state says (a checkpoint without a batch number: batches = steps)."""
    saved = saved or {}
    if "kl_ctl" in saved:
        kl_ctl = kl_ctl.load_state_dict(saved["kl_ctl"])
    batch = int(saved.get("batch", step))
    return LoopState(
        version=version,
        synced=version,
        step=step,
        batches=batch,
        step_batch=batch,
        checkpointed=step,
        kl_ctl=kl_ctl,
        empty_batches=int(saved.get("empty_batches", 0)),
    )


def train_version(state: LoopState, number: int) -> int:
    """The policy version batch `number` will be trained at: the version now plus one for each
    earlier batch not yet done (async: the producer makes batch k while batch k-1 trains). The
    manager drops partial work staler than the bound at THAT version, so a surplus or aborted
    group kept from the batch before is not resumed (or served) only to be dropped as stale by
    the trainer, leaving the step short of groups."""
    return state.version + max(0, number - 1 - state.batches)
