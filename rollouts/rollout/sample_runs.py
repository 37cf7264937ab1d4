"""How one group's samples run: each through the generate function, or the whole group as one
engine request (`rollout.batch_groups`), under the batch's limit on samples in flight, timed,
with its request id (the batch's prefix first: what the surplus abort matches) and its sampling
seed (`seeds.request_seed`). A generate function that raises, times out or returns no finished
Sample fails only its sample; an engine pool with no engine left loses the whole batch.

Each sample generated here is timed: how long it waited for a slot (the limit on samples in
flight) and how long it generated; the manager adds its group's scoring and keeps the three in
the sample's `metadata["timing"]` (`with_timing`), for rollouts.jsonl and `rollouts show`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import trio

from rollouts.config import RolloutConfig
from rollouts.envs.protocol import EnvFactory
from rollouts.envs.threads import CallTimeout, ThreadRunner
from rollouts.inference.http import EngineUnavailable
from rollouts.inference.protocol import InferenceEngine
from rollouts.plugins import dotted_name
from rollouts.rollout.generate import DONE_STATUSES, fail_sample, generate_group_single_turn
from rollouts.rollout.planning import RoundState
from rollouts.rollout.protocol import GenerateContext
from rollouts.rollout.seeds import request_seed
from rollouts.rollout.signal import GroupSignal
from rollouts.rollout.trajectory import without_tokens
from rollouts.types import Sample, Status
from rollouts.wire.generation import SamplingParams

Group = tuple[Sample, ...]
TIMING_KEY = "timing"  # Sample.metadata: {"queue_s", "generate_s", "reward_s"[, "teacher_s"]}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupResult:
    """A group back from generation (and scoring), with the engine work it took."""

    group: Group
    gen_time_s: float
    gen_tokens: int


@dataclasses.dataclass(kw_only=True, slots=True)
class BatchRun:
    """Mutable bookkeeping of one `generate_batch` call (never outlives it)."""

    state: RoundState
    batch_id: str
    number: int  # the batch number the sampling seeds derive from
    reward: Callable[..., Any]
    limiter: trio.CapacityLimiter
    send: trio.MemorySendChannel[GroupResult]
    borrowing: trio.Lock = dataclasses.field(default_factory=trio.Lock)  # see _borrow
    aborting: bool = False
    kept: list[Group] = dataclasses.field(default_factory=list)
    partial: list[Group] = dataclasses.field(default_factory=list)
    dropped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failed: list[Sample] = dataclasses.field(default_factory=list)  # the first MAX_FAILED_KEPT
    lost: EngineUnavailable | None = None  # no engine could generate: the batch is lost
    scope: trio.CancelScope | None = None  # the batch's nursery (a lost batch cancels it)
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    gen_time_s: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    signals: list[GroupSignal | None] = dataclasses.field(default_factory=list)  # per verdict


def reset_sample(sample: Sample) -> Sample:
    """A sample back to PENDING with nothing generated (restart from the prompt)."""
    return dataclasses.replace(without_tokens(sample), reward=None, status=Status.PENDING)


def with_timing(sample: Sample, timing: Mapping[str, float]) -> Sample:
    """The sample with `timing` added to its `metadata["timing"]` (seconds, summed over the
    batches that worked on it: a partial rollout resumed later waits and generates again)."""
    assert all(v >= 0.0 for v in timing.values()), f"negative time in {timing=}"
    if not timing:
        return sample
    before = sample.metadata.get(TIMING_KEY, {})
    summed = {**before, **{k: float(before.get(k, 0.0)) + v for k, v in timing.items()}}
    return dataclasses.replace(sample, metadata={**sample.metadata, TIMING_KEY: summed})


def is_unfinished(group: Sequence[Sample]) -> bool:
    """A group with a sample that was aborted or never started."""
    return any(s.status in (Status.ABORTED, Status.PENDING) for s in group)


@dataclasses.dataclass(kw_only=True)
class SampleRunner:
    """Runs a group's samples for the manager (see the module docstring)."""

    config: RolloutConfig
    engines: InferenceEngine
    tokenizer: Any
    generate_fn: Callable[..., Any]
    env_factory: EnvFactory | None
    sampling: SamplingParams
    seed: int | None  # the run's seed; None: requests carry no sampling seed
    batch_groups: bool  # a group as one engine request
    threads: ThreadRunner

    @property
    def _name(self) -> str:
        """How errors name the generate function: 'generate_fn pkg.mod.fn'."""
        return f"generate_fn {dotted_name(self.generate_fn)}"

    async def run(
        self, run: BatchRun, samples: list[Sample], times: list[float], starts: list[float]
    ) -> None:
        """Generate the group's unfinished samples in place (`samples[i]`; `times[i]` its
        generation's seconds, `starts[i]` when it started, `time.perf_counter`)."""
        assert len(times) == len(samples) == len(starts), f"{len(times)=} {len(samples)=}"
        if self.batch_groups:
            await self._run_group_batched(run, samples, times, starts)
            return
        async with trio.open_nursery() as nursery:
            for i in range(len(samples)):
                nursery.start_soon(self._run_sample, run, samples, (times, starts), i)

    def _seed(self, run: BatchRun, sample: Sample, i: int) -> int | None:
        """Sample i's sampling seed in this batch (None when the run gave no seed)."""
        if self.seed is None:
            return None
        return request_seed(self.seed, run.number, sample.group_index, i, sample.response_length)

    def _context(self, run: BatchRun, sample: Sample, i: int) -> GenerateContext:
        return GenerateContext(
            engine=self.engines,
            tokenizer=self.tokenizer,
            sampling=dataclasses.replace(self.sampling, seed=self._seed(run, sample, i)),
            rid=self._rid(run, sample, i),
            max_total_tokens=self.config.max_total_tokens,
            max_turns=self.config.max_turns,
            env_factory=self.env_factory,
            mask_off_policy_partial=self.config.mask_off_policy_partial,
            threads=self.threads,
            env_timeout_s=self.config.env_timeout_s,
        )

    @staticmethod
    def _rid(run: BatchRun, sample: Sample, i: int) -> str:
        """Sample i's request id: the batch's prefix (what the surplus abort matches) first."""
        return f"{run.batch_id}-g{sample.group_index}-s{i}"

    async def _run_sample(
        self,
        run: BatchRun,
        samples: list[Sample],
        clocks: tuple[list[float], list[float]],
        i: int,
    ) -> None:
        sample = samples[i]
        times, starts = clocks
        async with run.limiter:
            if run.aborting or sample.status in DONE_STATUSES:
                return  # not started (stays PENDING / ABORTED) or finished in an earlier batch
            t0 = starts[i] = time.perf_counter()
            try:
                out = await self.threads.call(
                    "generate_fn (rollout.generate_timeout_s)",
                    self.config.generate_timeout_s,
                    self.generate_fn,
                    sample,
                    self._context(run, sample, i),
                )
                if not isinstance(out, Sample) or out.status is Status.PENDING:
                    raise TypeError(
                        f"returned {type(out).__name__} (status "
                        f"{getattr(out, 'status', None)}); expected a finished Sample"
                    )
            except CallTimeout as e:  # says what timed out, and after how long
                out = fail_sample(sample, str(e), "generate/timed_out")
            except EngineUnavailable as e:  # no engine is left: not this sample's fault
                self.lose(run, e)
                return
            except Exception as e:
                out = fail_sample(sample, f"{self._name} raised {type(e).__name__}: {e}")
            times[i] = time.perf_counter() - t0
            samples[i] = out
            self._count_resume(run, sample, out)

    async def _run_group_batched(
        self, run: BatchRun, samples: list[Sample], times: list[float], starts: list[float]
    ) -> None:
        """The group's unfinished samples as one batch request (in chunks of at most
        `max_concurrency`, the samples in flight the limiter allows)."""
        todo = [i for i, s in enumerate(samples) if s.status not in DONE_STATUSES]
        size = self.config.max_concurrency
        for chunk in (todo[k : k + size] for k in range(0, len(todo), size)):
            async with self._borrow(run, len(chunk)):
                if run.aborting:
                    return  # not started: stays PENDING / ABORTED
                before = [samples[i] for i in chunk]
                rids = [self._rid(run, samples[i], i) for i in chunk]
                seeds = [self._seed(run, samples[i], i) for i in chunk]
                t0 = time.perf_counter()
                try:
                    after = await self.threads.call(
                        "generate_fn (rollout.generate_timeout_s)",
                        self.config.generate_timeout_s,
                        generate_group_single_turn,
                        before,
                        self._context(run, before[0], chunk[0]),
                        rids,
                        seeds,
                    )
                except CallTimeout as e:
                    after = [fail_sample(s, str(e), "generate/timed_out") for s in before]
                except EngineUnavailable as e:  # no engine is left: the batch is lost
                    self.lose(run, e)
                    return
                except Exception as e:
                    error = f"{self._name} raised {type(e).__name__}: {e}"
                    after = [fail_sample(s, error) for s in before]
                elapsed = time.perf_counter() - t0
                for i, old, new in zip(chunk, before, after, strict=True):
                    times[i], starts[i], samples[i] = elapsed, t0, new
                    self._count_resume(run, old, new)

    @staticmethod
    def lose(run: BatchRun, error: EngineUnavailable) -> None:
        """No engine could generate: the whole batch stops now (`generate_batch` raises)."""
        run.lost = run.lost or error
        assert run.scope is not None, "a batch's samples run inside its nursery"
        run.scope.cancel()

    @contextlib.asynccontextmanager
    async def _borrow(self, run: BatchRun, k: int) -> AsyncIterator[None]:
        """Hold `k` of the limiter's tokens (one per sample in flight). Groups take theirs one
        group at a time, so two half-served groups never wait on each other."""
        borrowers = [object() for _ in range(k)]
        held: list[object] = []
        try:
            async with run.borrowing:
                for b in borrowers:
                    try:  # a free token without a checkpoint (a task switch each, 16 a group)
                        run.limiter.acquire_on_behalf_of_nowait(b)
                    except trio.WouldBlock:
                        await run.limiter.acquire_on_behalf_of(b)
                    held.append(b)
            yield
        finally:
            for b in held:
                run.limiter.release_on_behalf_of(b)

    @staticmethod
    def _count_resume(run: BatchRun, before: Sample, after: Sample) -> None:
        """Count an ABORTED sample that was continued (resumed) or started over (restarted); one
        aborted before its first token had nothing to resume or lose, and is neither."""
        if before.status is not Status.ABORTED or after.status is Status.FAILED:
            return
        if not before.tokens:
            return
        resumed = len(after.metadata.get("resumed_at", ())) > len(
            before.metadata.get("resumed_at", ())
        )  # a generate fn that cannot resume (multi-turn) starts over: not a resume
        run.counts["resumed_samples" if resumed else "restarted_samples"] += 1
