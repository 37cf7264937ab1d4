"""Held-out evaluation through the engines: greedy completions, scored by the reward function.

Runs against any InferenceEngine (a pool included), so it measures exactly what the engines
serve after a weight sync, not a copy of the weights held by the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import trio

from rollouts.data.sft import tokenize_prompt
from rollouts.inference.protocol import InferenceEngine, SamplingParams
from rollouts.plugins import call_maybe_async
from rollouts.types import PromptItem, Sample


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalResult:
    """Accuracy (share of samples whose reward reaches `correct_at`) and the scored samples."""

    accuracy: float
    reward_mean: float
    response_length_mean: float
    samples: tuple[Sample, ...]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/reward_mean": self.reward_mean,
            f"{prefix}/response_length_mean": self.response_length_mean,
        }


async def _greedy_sample(
    engine: InferenceEngine, tokenizer: Any, item: PromptItem, sampling: SamplingParams
) -> Sample:
    prompt_ids = tokenize_prompt(tokenizer, item.prompt)
    completion = await engine.generate(prompt_ids, sampling)
    tokens = tuple(prompt_ids) + completion.output_ids
    return Sample(
        index=item.index,
        group_index=item.index,
        prompt=item.prompt,
        label=item.label,
        tokens=tokens,
        loss_mask=(0,) * len(prompt_ids) + (1,) * len(completion.output_ids),
        response_length=len(completion.output_ids),
        rollout_logprobs=completion.logprobs,
        status=completion.finish_reason.to_status(),
        weight_versions=(completion.weight_version,),
    )


async def evaluate(
    engine: InferenceEngine,
    tokenizer: Any,
    items: Sequence[PromptItem],
    reward_fn: Callable[[Sample], Any],
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    max_concurrency: int = 64,
    correct_at: float = 1.0,
    timeout_s: float = 600.0,
) -> EvalResult:
    """Greedy-decode every item, score it, and return accuracy and mean reward.

    A reward function that raises fails the evaluation (it is never counted as wrong silently).
    """
    assert items, "evaluation needs at least one item"
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=tuple(stop))
    results: list[Sample | None] = [None] * len(items)
    limiter = trio.CapacityLimiter(max_concurrency)

    async def one(i: int, item: PromptItem) -> None:
        async with limiter:
            sample = await _greedy_sample(engine, tokenizer, item, sampling)
        reward = await call_maybe_async(reward_fn, sample)
        results[i] = dataclasses.replace(sample, reward=float(reward))

    with trio.fail_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for i, item in enumerate(items):
                nursery.start_soon(one, i, item)
    samples = tuple(s for s in results if s is not None)
    assert len(samples) == len(items), f"{len(samples)=} != {len(items)=}"
    rewards = [float(s.reward) for s in samples]  # type: ignore[arg-type]
    return EvalResult(
        accuracy=sum(r >= correct_at for r in rewards) / len(rewards),
        reward_mean=sum(rewards) / len(rewards),
        response_length_mean=sum(s.response_length for s in samples) / len(samples),
        samples=samples,
    )
