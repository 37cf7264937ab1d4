"""Held-out evaluation through the engines: greedy rollouts, scored by the reward function.

It runs the same generate function as training (single-turn, or the multi-turn agent loop with
its environment) against the engines, with temperature 0, so it measures exactly what the
engines serve after a weight sync, not a copy of the weights held by the trainer. Rewards are
scored exactly as in training (`rollouts.rewards.scoring.score_sample`): a reward function that
raises, times out or returns a non-reward (None, a string, NaN, an infinity) marks that sample
FAILED with an error that names the function. `eval/accuracy` and the other means are over the
samples that were scored; the FAILED ones are counted apart (`eval/failed`, and by reason:
`eval/reward_failed/non_finite`, ...), never scored 0 (with a quarter of the rewards NaN, counting
them as 0 read 0.165 where the scored samples' accuracy was 0.228). An evaluation where every
sample failed is an error, not an accuracy of 0.
With the default single-turn generate function and an engine that takes batches (SGLang's API,
the built-in server), prompts go out EVAL_BATCH at a time as one request each (each prompt with
its own request id, so an abort still reaches only what it names); greedy answers are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from rollouts.data.loaders import SOURCE_KEY
from rollouts.failures import count_failures, failure_lines, failure_metrics, full_error
from rollouts.inference.http import EngineError
from rollouts.inference.protocol import InferenceEngine, batches_requests
from rollouts.plugins import call_maybe_async
from rollouts.rewards.scoring import score_group
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.generate import (
    fail_sample,
    generate_group_single_turn,
    generate_single_turn,
)
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import PromptItem, Sample, Status
from rollouts.wire.generation import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalResult:
    """An evaluation over its scored samples: accuracy (share whose reward reaches
    `correct_at`), mean reward and length; the FAILED ones (no reward) counted apart."""

    accuracy: float  # over the `scored` samples
    reward_mean: float
    response_length_mean: float
    scored: int
    failed: int
    failures: Mapping[str, int]  # FAILED samples by reason (`rollouts.failures`)
    samples: tuple[Sample, ...]
    correct_at: float = 1.0  # the reward that counts as correct

    def __post_init__(self) -> None:
        assert self.scored > 0, f"an evaluation with {self.scored=} has no accuracy"
        total = self.scored + self.failed
        assert total == len(self.samples), f"{self.scored=} + {self.failed=} != {total}"
        assert sum(self.failures.values()) == self.failed, f"{self.failures=} != {self.failed=}"

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """`eval/accuracy` (and the means) over the scored samples, `eval/scored`,
        `eval/failed` and the failures by reason (`eval/reward_failed/non_finite`, ...)."""
        return (
            {
                f"{prefix}/accuracy": self.accuracy,
                f"{prefix}/reward_mean": self.reward_mean,
                f"{prefix}/response_length_mean": self.response_length_mean,
                f"{prefix}/scored": float(self.scored),
                f"{prefix}/failed": float(self.failed),
            }
            | failure_metrics(self.failures, prefix)
            | self._per_source(prefix)
        )

    def _per_source(self, prefix: str) -> dict[str, float]:
        """A mixture's held-out sets apart: `eval/<source>/accuracy`, `reward_mean`, `scored`
        and `failed` (the source each prompt names in its metadata; nothing for one dataset)."""
        names = sorted(
            {str(s.metadata[SOURCE_KEY]) for s in self.samples if SOURCE_KEY in s.metadata}
        )
        out: dict[str, float] = {}
        for name in names:
            mine = [s for s in self.samples if s.metadata.get(SOURCE_KEY) == name]
            rewards = [_scalar(s.reward) for s in mine if s.status is not Status.FAILED]
            out[f"{prefix}/{name}/scored"] = float(len(rewards))
            out[f"{prefix}/{name}/failed"] = float(len(mine) - len(rewards))
            if rewards:  # a source whose every sample failed has no accuracy, never a 0
                out[f"{prefix}/{name}/accuracy"] = sum(r >= self.correct_at for r in rewards) / len(
                    rewards
                )
                out[f"{prefix}/{name}/reward_mean"] = sum(rewards) / len(rewards)
        return out

    def report(self) -> tuple[str, ...]:
        """Nothing when no sample failed; else 'held-out eval: 2 sample(s) failed (reward
        raised 2); accuracy over the 6 scored' and the first error of each reason in full."""
        failed = [s for s in self.samples if s.status is Status.FAILED]
        head = "held-out eval"
        lines = failure_lines(head, self.failures, failed, {}, max_full=1).lines
        if not lines:
            return ()
        first, *rest = lines
        return (f"{first}; accuracy {self.accuracy:.3f} over the {self.scored} scored", *rest)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalSpec:
    """How to roll out one eval item: greedy sampling, and the agent settings of training."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    max_total_tokens: int = 1024
    max_turns: int = 1
    env_factory: Any = None
    generate_fn: Callable[..., Any] | None = None  # None = single-turn or the agent loop
    reward_timeout_s: float = 10.0  # per sample, as `rollout.reward_timeout_s` in training


def _pending(item: PromptItem) -> Sample:
    return Sample(
        index=item.index,
        group_index=item.index,
        prompt=item.prompt,
        label=item.label,
        metadata=dict(item.metadata),
    )


MAX_EVAL_ATTEMPTS = 3  # an aborted eval rollout is resumed (greedy: same result) this often
EVAL_BATCH = 16  # prompts per batch request (engines that take batches, single-turn)
ABORTED_ERROR = f"eval rollout aborted {MAX_EVAL_ATTEMPTS} times in a row"


class EvalFailedError(RuntimeError):
    """Every sample of an evaluation FAILED: there is no accuracy to report."""


async def _rollout(engine: InferenceEngine, tokenizer: Any, item: PromptItem, spec: EvalSpec):
    """One greedy rollout of `item`; an ABORTED one (a pause or an abort aimed at other
    requests) is resumed, and is FAILED if still aborted: never scored as a finished one."""
    sample = _pending(item)
    for attempt in range(MAX_EVAL_ATTEMPTS):
        sample = await _attempt(engine, tokenizer, sample, spec, attempt)
        if sample.status is not Status.ABORTED:
            return sample
    return fail_sample(sample, ABORTED_ERROR, "generate/aborted")


async def _rollout_batch(
    engine: InferenceEngine, tokenizer: Any, items: Sequence[PromptItem], spec: EvalSpec
) -> list[Sample]:
    """`_rollout` for several items as one batch request per attempt: the aborted ones are
    resumed together, and FAILED if still aborted after the last attempt."""
    samples = [_pending(item) for item in items]
    for attempt in range(MAX_EVAL_ATTEMPTS):
        todo = [i for i, s in enumerate(samples) if s.status in (Status.PENDING, Status.ABORTED)]
        if not todo:
            break
        ctx = _context(engine, tokenizer, spec, f"eval-b{samples[todo[0]].index}-a{attempt}")
        rids = [f"eval-{samples[i].index}-a{attempt}" for i in todo]
        done = await generate_group_single_turn([samples[i] for i in todo], ctx, rids)
        for i, sample in zip(todo, done, strict=True):
            samples[i] = sample
    return [
        fail_sample(s, ABORTED_ERROR, "generate/aborted") if s.status is Status.ABORTED else s
        for s in samples
    ]


def _batched(engine: InferenceEngine, spec: EvalSpec) -> bool:
    """Whether eval prompts go out EVAL_BATCH at a time (default single-turn generation)."""
    multi = spec.env_factory is not None or spec.max_turns > 1
    return spec.generate_fn is None and not multi and batches_requests(engine)


def _context(engine: InferenceEngine, tokenizer: Any, spec: EvalSpec, rid: str) -> Any:
    return GenerateContext(
        engine=engine,
        tokenizer=tokenizer,
        sampling=SamplingParams(
            max_new_tokens=spec.max_new_tokens, temperature=0.0, stop=spec.stop
        ),
        rid=rid,
        max_total_tokens=spec.max_total_tokens,
        max_turns=spec.max_turns,
        env_factory=spec.env_factory,
    )


async def _attempt(
    engine: InferenceEngine, tokenizer: Any, sample: Sample, spec: EvalSpec, attempt: int
) -> Sample:
    multi = spec.env_factory is not None or spec.max_turns > 1
    generate = spec.generate_fn or (generate_multi_turn if multi else generate_single_turn)
    ctx = _context(engine, tokenizer, spec, f"eval-{sample.index}-a{attempt}")
    return await call_maybe_async(generate, sample, ctx)


async def evaluate(
    engine: InferenceEngine,
    tokenizer: Any,
    items: Sequence[PromptItem],
    reward_fn: Callable[[Sample], Any],
    spec: EvalSpec,
    *,
    max_concurrency: int = 64,
    correct_at: float = 1.0,
    timeout_s: float = 600.0,
) -> EvalResult:
    """Greedy-roll out every item, score it, and return accuracy and mean reward.

    A rollout that FAILED (engine error) or a sample whose reward FAILED is counted in `failed`
    (by reason) and left out of the accuracy and the means, never scored 0; when every sample
    failed the evaluation is an error (EvalFailedError) naming the reasons and the first errors.
    """
    assert items, "evaluation needs at least one item"
    results: list[Sample | None] = [None] * len(items)
    size = EVAL_BATCH if _batched(engine, spec) else 1
    limiter = trio.CapacityLimiter(max(1, max_concurrency // size))

    async def chunk(start: int) -> None:
        part = items[start : start + size]
        async with limiter:
            try:
                if size > 1:
                    samples = await _rollout_batch(engine, tokenizer, part, spec)
                else:
                    samples = [await _rollout(engine, tokenizer, part[0], spec)]
            except EngineError as e:  # counted in `failed`; all failing is an error below
                error = f"{type(e).__name__}: {e}"
                samples = [fail_sample(_pending(it), error, "generate/engine_error") for it in part]
        scored = await score_group(samples, reward_fn, spec.reward_timeout_s)
        results[start : start + len(scored)] = scored

    with trio.fail_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for start in range(0, len(items), size):
                nursery.start_soon(chunk, start)
    samples = tuple(s for s in results if s is not None)
    assert len(samples) == len(items), f"{len(samples)=} != {len(items)=}"
    return eval_result(samples, correct_at)


def eval_result(samples: Sequence[Sample], correct_at: float = 1.0) -> EvalResult:
    """Accuracy and means over the scored samples; the FAILED ones counted by reason. Every
    sample FAILED is an error (EvalFailedError) naming the reasons and the first errors: an
    accuracy of no sample is no accuracy, and never a 0."""
    assert samples, "an evaluation needs at least one sample"
    failed = [s for s in samples if s.status is Status.FAILED]
    scored = [s for s in samples if s.status is not Status.FAILED]
    failures = count_failures(failed)
    if not scored:
        report = failure_lines("every eval rollout failed", failures, failed, {}, max_full=1)
        first = full_error(failed[0])  # then the first error of each other reason: one line
        others = "".join(f"; {line.strip()}" for line in report.lines[1:] if first not in line)
        raise EvalFailedError(
            f"{report.lines[0]}; first: {first}{others}; held-out accuracy would mean nothing: "
            "fix the reward function (or the engines) and run again"
        )
    rewards = [_scalar(s.reward) for s in scored]
    return EvalResult(
        accuracy=sum(r >= correct_at for r in rewards) / len(rewards),
        reward_mean=sum(rewards) / len(rewards),
        response_length_mean=sum(s.response_length for s in scored) / len(scored),
        scored=len(scored),
        failed=len(failed),
        failures=failures,
        samples=tuple(samples),
        correct_at=correct_at,
    )


def _scalar(reward: Any) -> float:
    assert reward is not None, "a scored sample that did not fail has a reward"
    return float(sum(reward)) if isinstance(reward, tuple) else float(reward)
