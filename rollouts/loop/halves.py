"""The two halves of an RL run, apart: rollout-only (generate, score, write each batch; no
trainer) and the replay's batch source (read them back; the RL loop trains with no engines).

Rollout-only (`run_rollout_only`): the engines keep the starting weights, so every batch is made
by version 0; each step's line has the rollout figures a normal step logs, `time/generate_s`
and `time/save_batch_s`. A replay (`ReplaySource`, handed to `rl.run_rl_training`): step k
trains the stored batch k through the same step code as the run that stored it, so the same
starting model and config give the same losses and weights; its line's `time/load_batch_s` is
the read. What a replay of a rollout-only run reproduces, and what it cannot: the README's
"Rollout-only and replay runs".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from rollouts.algorithms.kl import AdaptiveKL
from rollouts.config import Config
from rollouts.data.buffer import DataBuffer
from rollouts.failures import failure_metrics, merge_counts
from rollouts.loop.batch import prepare_groups, step_timing
from rollouts.loop.batch_files import BatchWriter, check_shape, read_batch, step_dir
from rollouts.loop.rl import _batch_metrics, _count_empty
from rollouts.loop.sources import BatchSource, Made
from rollouts.loop.state import RLResult, StepLog, loop_state_from
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.planning import staleness_bound
from rollouts.types import RolloutBatch

BASE_VERSION = "0"  # what rollout-only engines serve throughout


class ReplaySource:
    """The RL loop's batches, read from a run's `batches/` (`batch_files.py`): batch k is the
    stored step k (a replay trains every batch it reads, so numbers and steps agree). Each
    batch is checked against the config's shape as it is read."""

    def __init__(self, root: Path, config: Config) -> None:
        self.phase = "load_batch"
        self.root = root
        self.config = config

    async def next(self, number: int) -> Made:
        started = time.monotonic()
        stored = await trio.to_thread.run_sync(read_batch, self.root, number)
        check_shape(self.config, stored.shape, step_dir(self.root, number))
        batch = RolloutBatch(groups=stored.groups, metadata=stored.metadata)
        return batch, time.monotonic() - started

    def restore_held(self, state: dict[str, Any] | None) -> int | None:
        assert not state, "a replay holds no batch made ahead"
        return None

    def start_producer(self, nursery: trio.Nursery, first: int, last: int) -> None:
        raise AssertionError("a replay reads its batches in turn: no producer")

    def raise_limit(self, last: int) -> None:
        pass

    def forget_before(self, number: int) -> None:
        pass

    async def take_ahead(self, number: int) -> None:
        raise AssertionError("a replay holds no batch made ahead")

    def held_state(self) -> dict[str, Any] | None:
        return None

    def state_for_resume(self, next_number: int) -> dict[str, Any]:
        """What a checkpoint keeps in place of a DataBuffer state: where the batches come from."""
        return {"replay": str(self.root), "next_step": next_number}


async def run_rollout_only(
    manager: AsyncRolloutManager,
    buffer: DataBuffer,
    config: Config,
    metrics_logger: StepLog,
    *,
    writer: BatchWriter,
    should_stop: Callable[[], bool] = lambda: False,
    report_batch: Callable[[int, int, RolloutBatch], None] | None = None,
    reward_fn: Any = None,
) -> RLResult:
    """Make `training.rl_steps` batches with the engines as they are (the starting weights) and
    write each as a step would train it (its groups past FAILED and ABORTED samples); a batch
    that would train nothing is counted as the RL loop counts it. No trainer, no weight sync,
    no checkpoint; `should_stop` (SIGINT) ends it after the batch written; `report_batch` is
    the RL loop's hook (`RLHooks.report_batch`)."""
    bound = staleness_bound(
        config.rollout.max_staleness, config.rollout.mode, config.weight_sync.every
    )
    batches = BatchSource(manager, reward_fn, buffer, lambda number: (BASE_VERSION, bound))
    st = loop_state_from(None, AdaptiveKL.from_config(config.algorithm), 0, 0)
    while st.step < config.training.rl_steps and not should_stop():
        number = st.batches + 1
        started = time.monotonic()
        rollout, gen_s = await batches.next(number)
        prep = prepare_groups(rollout.groups, BASE_VERSION, bound)
        metrics, times = _batch_metrics(rollout, prep, gen_s, gen_s, False)
        if report_batch is not None:  # failures said, sampled rows in rollouts.jsonl
            report_batch(st.step + 1, number, rollout)
        st.batches = number
        if not prep.groups:
            _count_empty(st, number, rollout, prep)
            continue
        st.step += 1
        st.step_batch = number
        batches.forget_before(number + 1)
        times["save_batch"] = await writer.write(
            st.step, number, 0, prep.groups, rollout.metadata, None
        )
        metrics["rollout/empty_batches"] = float(st.empty_since_step)
        failed = merge_counts(rollout.metadata.get("failures", {}), st.failures_since_step)
        metrics |= failure_metrics(failed, "rollout")
        st.failures_since_step = {}
        st.empty_in_a_row = st.empty_since_step = 0
        st.metrics = metrics | step_timing(times, time.monotonic() - started, rollout, 0)
        metrics_logger.log(st.step, st.metrics)
    return RLResult(steps=st.step, weight_version=BASE_VERSION, last_metrics=st.metrics)
