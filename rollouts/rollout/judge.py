"""An LLM judge as the reward (`rollout.reward_fn = "judge"`, [judge]): each finished sample is
put to the judge's engines as a question (`judge.template` with the sample's question, response
and reference filled in, in the judge's own chat template), answered greedily, and the score
parsed from the answer (`judge.pattern`) and scaled to [0, 1].

It is an async reward function, so the scorer runs it like any other: concurrently within a
group, each under `rollout.reward_timeout_s`, at most `judge.max_concurrency` questions in
flight. An answer with no score, or one outside [score_min, score_max], raises `RewardUnparsed`:
the sample FAILED (`reward/unparsed`), counted, never a 0. A judge pool with no engine left
raises `RewardServiceUnavailable`, which loses the batch and stops the run, as the policy's pool
does."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import trio

from rollouts.config.served import JudgeConfig
from rollouts.data.sft import tokenize_prompt
from rollouts.inference.http import EngineUnavailable
from rollouts.inference.protocol import InferenceEngine
from rollouts.rewards.protocol import RewardServiceUnavailable, RewardUnparsed
from rollouts.types import Sample
from rollouts.wire.generation import SamplingParams


def question_of(sample: Sample) -> str:
    """The question the sample answers: the prompt's last user message, or the prompt text."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    users = [m for m in sample.prompt if m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else ""


def parse_score(answer: str, config: JudgeConfig) -> float:
    """The first `config.pattern` match's number in `answer`, scaled to [0, 1]; raises
    RewardUnparsed when there is none or it is out of [score_min, score_max]."""
    found = re.search(config.pattern, answer)
    if found is None:
        raise RewardUnparsed(f"the judge's answer has no score (judge.pattern): {answer!r:.200}")
    try:
        value = float(found.group(1))
    except ValueError as e:
        raise RewardUnparsed(f"the judge's score {found.group(1)!r} is not a number") from e
    lo, hi = config.score_min, config.score_max
    if not lo <= value <= hi:
        raise RewardUnparsed(f"the judge's score {value:g} is outside [{lo:g}, {hi:g}]")
    return (value - lo) / (hi - lo)


@dataclasses.dataclass(kw_only=True)
class Judge:
    """The judge reward (see the module docstring). `tokenizer`: the judge's."""

    engines: InferenceEngine
    tokenizer: Any
    config: JudgeConfig

    def __post_init__(self) -> None:
        self.limiter = trio.CapacityLimiter(self.config.max_concurrency)
        self.sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=0.0)

    def question(self, sample: Sample) -> list[int]:
        """The judge's prompt for `sample`, as its token ids."""
        response = str(sample.metadata.get("response_text", ""))
        reference = "" if sample.label is None else str(sample.label)
        text = self.config.template.format_map(
            _Fields(question=question_of(sample), response=response, reference=reference)
        )
        prompt: Any = ({"role": "user", "content": text},) if self.config.chat else text
        return tokenize_prompt(self.tokenizer, prompt)

    async def answer(self, sample: Sample) -> str:
        """The judge's answer to the question about `sample`."""
        async with self.limiter:
            try:
                completion = await self.engines.generate(self.question(sample), self.sampling)
            except EngineUnavailable as e:
                raise RewardServiceUnavailable(f"no judge engine is left: {e}") from e
        return self.tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)

    async def __call__(self, sample: Sample) -> float:
        return parse_score(await self.answer(sample), self.config)


class _Fields(dict):
    """Template fields; an unknown {name} stays as it is (a template may show braces)."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
