"""AsyncRolloutManager: over-sampled, filtered, abortable batch generation under trio.

One `generate_batch` call: take groups from the DataBuffer (partial groups first), run them
concurrently (a CapacityLimiter bounds samples in flight), score each finished group, pass it
through the group filters, and once `batch_size` groups are kept abort the rest on the engines:
only this batch's requests (their request ids share the batch's prefix), never another batch's
or an evaluation's. Aborted groups go back to the DataBuffer's partial pool and resume in a
later batch; so do surplus groups that finished before the abort reached them (re-scored and
re-filtered then, no generation). With `partial_rollouts` off, aborted groups go back reset to
their prompts (counted in `restarted_groups`: regenerated from scratch, not dropped) and
finished surplus groups are dropped (reason "surplus"). Given the policy version and the
staleness bound, partial groups already too stale to train are dropped before any generation is
spent on them (`stale_partial_groups`). What a batch throws away (filtered, surplus dropped,
restarted, or too stale: generated in this batch or an earlier one) is counted in tokens
(`discarded_tokens`, and `discarded_fraction` of the tokens generated in the batch; the trainer
adds what it drops as stale). How many groups to submit, and when the batch is done or
short, is decided by `planning` (pure). A short batch trains as it is (`on_short_batch =
"warn"`): its metadata says so (`short_batch`, and why in `short_batch_message`), and the
driver prints it; no Python warning is raised. FAILED samples (a reward or generate function
that raised, timed out or returned no reward) are counted by reason (`metadata["failures"]`,
`rollouts.failures`), and the first `MAX_FAILED_KEPT` leave with the batch
(`RolloutBatch.failed`), for the console and rollouts.jsonl.

A group's samples run in `sample_runs.py` (`SampleRunner`). Generate functions run through a
`ThreadRunner`: an async one is awaited, a sync one runs in a worker thread, both under
`rollout.generate_timeout_s`, so a blocking one fails only its sample.
With the default single-turn generate function and engines that take batches (SGLang's API, the
built-in server), a group's samples go to the engine as ONE request (`rollout.batch_groups`):
one HTTP round trip instead of n, the shared prompt prefilled once; each sample keeps its own
request id, so aborts, partial resumes and weight versions stay per sample.

Given the run's seed, every request carries a sampling seed derived from the batch number and
the sample (`seeds.request_seed`), and the kept groups come out in group order, not in the
order they finished: the same seed gives the same batch, whatever the timing.

A batch's rewards are final when it leaves: the kept groups are shaped by `reward_shaping`
(`[reward]`: `rewards.shaping.shape_rewards`, over each group or the whole batch) after the
filters saw them as scored; the scored reward stays in `metadata["raw_reward"]`.

With a teacher (on-policy distillation, `teacher.py`), each finished group is scored by it
after the reward, while the rest of the batch generates: the samples carry `teacher_logprobs`.

Each group that reaches a verdict (kept, dropped by a filter or as surplus; not one saved for a
later batch) is described by `signal.group_signal`; their counts leave in
`metadata["group_signal"]` (the step's `groups/*`: how many groups carried no signal). Each
sample carries its times in `metadata["timing"]` (`sample_runs.with_timing`): waiting for a
slot, generating, and its group's scoring.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import trio

from rollouts import tracing
from rollouts.config import RewardConfig, RolloutConfig
from rollouts.config.rollout import EXTERNAL_CONCURRENCY
from rollouts.data.buffer import DataBuffer
from rollouts.envs import resolve_env_factory
from rollouts.envs.protocol import EnvFactory
from rollouts.envs.threads import ThreadRunner
from rollouts.failures import failed_in_group, failure_reason
from rollouts.inference.http import EngineUnavailable
from rollouts.inference.protocol import InferenceEngine, batches_requests
from rollouts.plugins import load_function
from rollouts.rewards.named import load_reward_fn
from rollouts.rewards.protocol import RewardServiceUnavailable
from rollouts.rewards.scoring import score_group
from rollouts.rewards.shaping import final_rewards
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.batch import (
    ShortBatchError,
    build_batch_metadata,
    convert_to_batch,
    discarded_fraction,
    response_tokens,
    short_batch_message,
)
from rollouts.rollout.filters import resolve_filters, run_filters
from rollouts.rollout.generate import (
    generate_single_turn,
    sampling_params_from_config,
)
from rollouts.rollout.planning import (
    Outcome,
    batch_outcome,
    groups_to_submit,
    is_stale_partial,
    new_round_state,
)
from rollouts.rollout.protocol import GenerateFn, GroupFilter
from rollouts.rollout.sample_runs import (
    BatchRun,
    GroupResult,
    SampleRunner,
    is_unfinished,
    reset_sample,
    with_timing,
)
from rollouts.rollout.signal import SIGNAL_KEY, group_signal, signal_counts
from rollouts.rollout.teacher import Teacher
from rollouts.types import RolloutBatch, Sample, Status

Group = tuple[Sample, ...]
ABORT_INTERVAL_S = 0.05  # how often surplus requests are aborted again while draining
ABORT_TIMEOUT_S = 5.0
MAX_FAILED_KEPT = 32  # FAILED samples a batch carries out (`RolloutBatch.failed`); all counted


class AsyncRolloutManager:
    """Generates RolloutBatches from a DataBuffer through an InferenceEngine (or EnginePool)."""

    def __init__(
        self,
        data_buffer: DataBuffer,
        config: RolloutConfig,
        engines: InferenceEngine,
        *,
        tokenizer: Any,
        generate_fn: str | Callable[..., Any] | None = None,
        reward_fn: str | Callable[..., Any] | None = None,
        filters: Sequence[str | GroupFilter] | None = None,
        env_factory: str | EnvFactory | None = None,
        seed: int | None = None,
        reward_shaping: RewardConfig | None = None,
        teacher: Teacher | None = None,
    ) -> None:
        self.buffer = data_buffer
        self.teacher = teacher  # on-policy distillation: scores each finished group's tokens
        self.reward_shaping = reward_shaping  # None: the batch keeps its rewards as scored
        self.seed = seed  # the run's seed; None: requests carry no sampling seed
        if not config.max_concurrency:  # automatic; the driver resolves it for built-in engines
            config = dataclasses.replace(config, max_concurrency=EXTERNAL_CONCURRENCY)
        self.config = config
        self.engines = engines
        self.tokenizer = tokenizer
        env = env_factory if env_factory is not None else config.env
        self.env_factory = resolve_env_factory(env) if env else None
        multi_turn = self.env_factory is not None or config.max_turns > 1
        default = generate_multi_turn if multi_turn else generate_single_turn
        self.generate_fn = load_function(generate_fn or config.generate_fn or default, GenerateFn)
        reward = reward_fn or config.reward_fn
        self.reward_fn = load_reward_fn(reward) if reward else None
        self.filters = resolve_filters(config.filters if filters is None else filters)
        self.sampling = sampling_params_from_config(config)
        # a group as one engine request: the default generate function, on engines that batch
        self.batch_groups = (
            config.batch_groups
            and self.generate_fn is generate_single_turn
            and batches_requests(engines)
        )
        self.threads = ThreadRunner(max(config.max_concurrency, 1))
        self.runner = SampleRunner(
            config=config,
            engines=engines,
            tokenizer=tokenizer,
            generate_fn=self.generate_fn,
            env_factory=self.env_factory,
            sampling=self.sampling,
            seed=seed,
            batch_groups=self.batch_groups,
            threads=self.threads,
        )
        self.batches_made = 0
        self.last_verdicts = (0, 0)  # (passed, judged) by the filters in the last batch

    async def generate_batch(
        self,
        reward_fn: Callable[..., Any] | None = None,
        *,
        policy_version: str | None = None,
        max_staleness: int | None = None,
        batch_number: int | None = None,
    ) -> RolloutBatch:
        """One batch of `batch_size` kept groups of `n_samples_per_prompt` (see module doc).

        With `policy_version` and `max_staleness`, partial groups already staler than the bound
        are dropped (counted) before any generation is spent on them. `batch_number` (the RL
        step's batch; default: the batches this manager made) enters the sampling seeds.
        """
        reward = load_reward_fn(reward_fn) if reward_fn else self.reward_fn
        if reward is None:
            raise ValueError("generate_batch needs a reward_fn (argument or rollout.reward_fn)")
        start = time.perf_counter()
        stale = self._drop_stale_partial(policy_version, max_staleness)
        send, recv = trio.open_memory_channel[GroupResult](self.config.max_concurrency)
        run = BatchRun(
            state=new_round_state(
                self.config.batch_size, self.config.over_sampling_factor, self.last_verdicts
            ),
            batch_id=f"b{self.batches_made}-{uuid.uuid4().hex[:8]}",
            number=self.batches_made if batch_number is None else batch_number,
            reward=reward,
            limiter=trio.CapacityLimiter(self.config.max_concurrency),
            send=send,
        )
        run.counts["stale_partial_groups"] = len(stale)
        run.counts["discarded_tokens"] = sum(map(response_tokens, stale))  # made in earlier batches
        async with send, recv, trio.open_nursery() as nursery:
            run.scope = nursery.cancel_scope
            self._submit(run, nursery)
            while run.state.in_flight > 0:
                result = await recv.receive()
                run.state = dataclasses.replace(run.state, in_flight=run.state.in_flight - 1)
                self._absorb(run, result)
                if run.aborting:
                    continue
                if batch_outcome(run.state, self.config.max_over_sampling_rounds) is Outcome.DONE:
                    run.aborting = True
                    nursery.start_soon(self._abort_until_cancelled, run.batch_id)
                else:
                    self._submit(run, nursery)
            nursery.cancel_scope.cancel()  # stops the abort loop (and a lost batch's samples)
        if run.lost is not None:  # nothing kept: the caller gives the prompts back
            self.batches_made += 1
            raise run.lost
        return self._finish(run, time.perf_counter() - start)

    def _drop_stale_partial(self, version: str | None, bound: int | None) -> list[Group]:
        """Take the partial groups already staler than `bound` at `version` out of the buffer
        (none without both); the groups taken."""
        stale: list[Group] = []
        if version is None or bound is None:
            return stale

        def is_stale(group: Group) -> bool:
            if is_stale_partial(group, version, bound):
                stale.append(group)
                return True
            return False

        self.buffer.drop_partial_groups(is_stale)
        return stale

    def _submit(self, run: BatchRun, nursery: trio.Nursery) -> None:
        n = groups_to_submit(
            run.state, self.config.over_sampling_factor, self.config.max_over_sampling_rounds
        )
        if n == 0:
            return
        groups = [
            tracing.samples_queued(g, run.number)
            for g in self.buffer.get_groups(n, self.config.n_samples_per_prompt)
        ]
        run.state = dataclasses.replace(
            run.state,
            in_flight=run.state.in_flight + len(groups),
            submitted=run.state.submitted + len(groups),
            exhausted=len(groups) < n,
        )
        run.counts["submitted_groups"] += len(groups)
        for group in groups:
            nursery.start_soon(self._run_group, run, group, run.send.clone())

    async def _run_group(
        self, run: BatchRun, group: Group, send: trio.MemorySendChannel[GroupResult]
    ) -> None:
        samples = list(group)
        times, starts = [0.0] * len(samples), [0.0] * len(samples)
        submitted = time.perf_counter()
        tracing.samples_stage(samples, "generate", begin=True)
        await self.runner.run(run, samples, times, starts)
        tracing.samples_stage(samples, "generate", begin=False)
        gen_tokens = sum(
            max(new.response_length - old.response_length, 0)
            for old, new in zip(group, samples, strict=True)
        )
        scoring: dict[str, float] = {}  # the group's scoring times (none for an unfinished one)
        try:
            t0 = time.perf_counter()
            scored = tuple(samples)
            if not is_unfinished(samples):
                scored = await self._score(samples, run.reward)
                scoring["reward_s"] = time.perf_counter() - t0
            if self.teacher is not None and not is_unfinished(scored):
                t0 = time.perf_counter()
                scored = await self.teacher.score_group(scored)
                scoring["teacher_s"] = time.perf_counter() - t0
        except EngineUnavailable as e:  # no teacher engine left: the batch is lost
            SampleRunner.lose(run, e)
            return
        except RewardServiceUnavailable as e:  # no judge engine left: the same
            SampleRunner.lose(run, EngineUnavailable(str(e)))
            return
        scored = tuple(
            with_timing(s, {"queue_s": max(t - submitted, 0.0), "generate_s": g, **scoring})
            if t > 0.0
            else with_timing(s, scoring)  # generated in an earlier batch: its scoring only
            for s, t, g in zip(scored, starts, times, strict=True)
        )
        async with send:
            await send.send(GroupResult(group=scored, gen_time_s=sum(times), gen_tokens=gen_tokens))

    async def _score(self, samples: list[Sample], reward: Callable[..., Any]) -> Group:
        """A group's samples scored concurrently, each bounded by `reward_timeout_s`."""
        tracing.samples_stage(samples, "reward", begin=True)
        scored = await score_group(samples, reward, self.config.reward_timeout_s)
        tracing.samples_stage(scored, "reward", begin=False)
        return scored

    async def _abort_until_cancelled(self, batch_id: str) -> None:
        """Abort this batch's surplus requests (by request-id prefix), and again while draining
        (a request may land after one)."""
        while True:
            try:
                with trio.fail_after(ABORT_TIMEOUT_S):
                    await self.engines.abort(f"{batch_id}-")
            except Exception as e:
                warnings.warn(
                    f"abort of {batch_id} failed: {type(e).__name__}: {e}",
                    RuntimeWarning,
                    stacklevel=1,
                )
            await trio.sleep(ABORT_INTERVAL_S)

    def _absorb(self, run: BatchRun, result: GroupResult) -> None:
        group = result.group
        run.counts["generated_tokens"] += result.gen_tokens
        run.gen_time_s["total"] += result.gen_time_s
        failed = [s for s in group if s.status is Status.FAILED]
        if not is_unfinished(group) or not self.config.partial_rollouts:
            run.counts["failed_samples"] += len(failed)  # every group, kept or not; once each
            run.failures.update(failure_reason(s) for s in failed)
            run.failed += failed_in_group(group)[: MAX_FAILED_KEPT - len(run.failed)]
        run.errors += [str(s.metadata.get("error", "")) for s in failed][: 10 - len(run.errors)]
        if is_unfinished(group):
            run.counts["aborted_samples"] += sum(s.status is Status.ABORTED for s in group)
            run.counts["unstarted_samples"] += sum(s.status is Status.PENDING for s in group)
            if not self.config.partial_rollouts:  # back to the prompts: regenerated, not dropped
                run.gen_time_s["discarded"] += result.gen_time_s
                run.counts["discarded_tokens"] += response_tokens(group)
                run.counts["restarted_groups"] += 1
                group = tuple(reset_sample(s) for s in group)
            run.partial.append(group)
            return
        verdict = run_filters(group, self.filters)
        run.state = dataclasses.replace(
            run.state, passed=run.state.passed + int(verdict.keep), judged=run.state.judged + 1
        )
        if verdict.keep and self.config.partial_rollouts and len(run.kept) >= run.state.target:
            run.counts["surplus_groups_saved"] += 1  # finished work, served first next batch
            run.partial.append(group)
            return
        run.signals.append(group_signal(group))  # a verdict: counted once, kept or dropped
        if verdict.keep and len(run.kept) < run.state.target:
            run.kept.append(group)
            run.state = dataclasses.replace(run.state, kept=len(run.kept))
            return
        run.dropped["surplus" if verdict.keep else verdict.reason] += 1
        for s in group:
            tracing.sample_ends(s, f"dropped: {'surplus' if verdict.keep else verdict.reason}")
        run.gen_time_s["discarded"] += result.gen_time_s
        run.counts["discarded_tokens"] += response_tokens(group)

    def _finish(self, run: BatchRun, elapsed_s: float) -> RolloutBatch:
        self.buffer.add_partial_groups(run.partial)
        self.last_verdicts = (run.state.passed, run.state.judged)
        self.batches_made += 1
        short = len(run.kept) < self.config.batch_size
        message = short_batch_message(
            len(run.kept), self.config.batch_size, run.state.rounds, run.dropped
        )
        if short and self.config.on_short_batch == "error":
            raise ShortBatchError(message + f"; errors: {run.errors[:3]}")
        total = run.gen_time_s["total"]
        kept = sorted(run.kept, key=lambda g: g[0].group_index)  # not the order they finished
        meta = build_batch_metadata(
            kept,
            dropped=run.dropped,
            elapsed_s=elapsed_s,
            generated_tokens=run.counts["generated_tokens"],
            rounds=run.state.rounds,
            short_batch=short,
            short_batch_message=message if short else "",
            failures=dict(sorted(run.failures.items())),
            partial_groups_saved=len(run.partial),
            sources=self.buffer.source_metrics(),  # a mixture's per-source draws and epochs
            errors=run.errors,
            abandoned_threads=self.threads.abandoned_alive,
            gen_time_s=total,
            discarded_gen_time_s=run.gen_time_s["discarded"],
            discarded_fraction=discarded_fraction(
                run.counts["discarded_tokens"], run.counts["generated_tokens"]
            ),
            **{k: v for k, v in run.counts.items() if k != "generated_tokens"},
            **{SIGNAL_KEY: signal_counts(run.signals)},
        )
        failed = tuple(run.failed)
        return convert_to_batch(final_rewards(kept, self.reward_shaping), meta, failed)
