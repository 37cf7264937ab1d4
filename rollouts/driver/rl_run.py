"""What the RL phase built (`RLRun`) and where it starts (`Resumed`), and the held-out
evaluations it runs through the engines: the policy's at each evaluation step, the teacher's
once before RL when distilling."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from rollouts.config import Config
from rollouts.data.buffer import DataBuffer
from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.driver.metrics import MetricsLogger
from rollouts.driver.setup import StopFlag
from rollouts.inference.pool import EnginePool
from rollouts.rewards.protocol import RewardFn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.teacher import Teacher
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.reference import ReferencePolicy
from rollouts.types import PromptItem


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    """Where the phase starts: step 0 of a new run, or a checkpoint's step."""

    step: int = 0
    version: int = 0
    metrics: dict[str, Any] | None = None  # the checkpointed step's metrics line
    loop_state: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RLRun:
    """Everything the RL phase built, for the loop's run with the engines up."""

    config: Config
    run_dir: Path
    backend: TrainingBackend
    buffer: DataBuffer
    pool: EnginePool
    tokenizer: Any
    reward_fn: RewardFn
    ref: ReferencePolicy | None
    resumed: Resumed
    stop: StopFlag
    eval_items: list[PromptItem]
    sync_root: Path  # the run's weight copies for the engines
    trainer_pid: int | None  # the trainer process, when training runs in one
    teacher: Teacher | None = None  # on-policy distillation's teacher ([teacher])


async def evaluate_teacher(run: RLRun, manager: AsyncRolloutManager) -> dict[str, float]:
    """The teacher's held-out accuracy, once before RL (`teacher/eval/accuracy`, in step 0's
    line): what the student's is measured against."""
    if run.teacher is None or not run.config.teacher.evaluate:
        return {}
    spec = eval_spec(run, manager)
    result = await evaluate(run.teacher.engines, run.tokenizer, run.eval_items, run.reward_fn, spec)
    for line in result.report():
        print(f"[teacher] {line}", flush=True)
    print(f"[teacher] held-out accuracy of the teacher: {result.accuracy:.3f}", flush=True)
    return result.metrics("teacher/eval")


def eval_spec(run: RLRun, manager: AsyncRolloutManager) -> EvalSpec:
    r = run.config.rollout
    return EvalSpec(
        max_new_tokens=r.sampling.max_new_tokens,
        stop=tuple(r.sampling.stop),
        max_total_tokens=r.max_total_tokens,
        max_turns=r.max_turns,
        env_factory=manager.env_factory,
        generate_fn=manager.generate_fn,
        reward_timeout_s=r.reward_timeout_s,
    )


def eval_hook(run: RLRun, manager: AsyncRolloutManager, logger: MetricsLogger) -> Any:
    """The held-out greedy evaluation through the engines (None when there is no held-out set);
    every episode goes to eval_rollouts.jsonl under the step it evaluates."""
    if not run.eval_items:
        return None
    items = run.eval_items
    spec = eval_spec(run, manager)
    decode = functools.partial(run.tokenizer.decode, skip_special_tokens=True)

    async def run_eval(step: int) -> dict[str, float]:
        result = await evaluate(run.pool, run.tokenizer, items, run.reward_fn, spec)
        for line in result.report():  # FAILED samples: counts by reason, first errors
            print(f"[train] {line}", flush=True)
        logger.log_samples(step, result.samples, decode, held_out=True)
        return result.metrics("eval")

    return run_eval
