"""The teacher's opinion of the student's own samples (on-policy distillation): each finished
sample's whole token sequence sent to the teacher's engines as a prompt, and its logprob of
every response token given everything before it kept on the sample (`teacher_logprobs`).

Groups are scored as they finish, while the rest of the batch generates; at most
`teacher.max_concurrency` sequences are in flight. Every call is bounded by the teacher engines'
`request_timeout_s`, and a hung or dead engine is handled by its pool as the policy's is (marked
down, the call moved on, waited for). A scoring the engine refuses fails its sample
(`teacher/engine_error`: counted, never trained on, never a 0); a teacher pool with no engine
left raises `EngineUnavailable`, which loses the batch and stops the run, as the policy's pool
does."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from rollouts.failures import mark_failed
from rollouts.inference.http import EngineError, EngineUnavailable
from rollouts.types import Sample, Status

SCORED = (Status.COMPLETED, Status.TRUNCATED)


class ScoresTokens(Protocol):
    """What the teacher needs of its engines (an `EnginePool`)."""

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> Any: ...

    async def prompt_top_logprobs(
        self, input_ids: Sequence[int], top: int, start: int = 1
    ) -> Any: ...


def response_logprobs(sample: Sample, served: Sequence[float]) -> tuple[float, ...]:
    """The response tokens' logprobs as the teacher served them (asked from the response's
    first token on: `served[i]` is response token i's given everything before it)."""
    if len(served) != sample.response_length:
        raise EngineError(
            f"the teacher returned {len(served)} logprobs for a response of "
            f"{sample.response_length} tokens"
        )
    return tuple(float(x) for x in served)


@dataclasses.dataclass(kw_only=True)
class Teacher:
    """Scores samples against `engines` (see the module docstring)."""

    engines: ScoresTokens
    max_concurrency: int = 16
    top_k: int = 0  # also keep the teacher's top-k at each response position (`teacher_top`)

    def __post_init__(self) -> None:
        assert self.max_concurrency >= 1, f"{self.max_concurrency=}"
        self.limiter = trio.CapacityLimiter(self.max_concurrency)

    async def score_group(self, samples: Sequence[Sample]) -> tuple[Sample, ...]:
        """The group with every finished, unscored sample scored (others as they were)."""
        out = list(samples)
        lost: list[EngineUnavailable] = []

        async def one(i: int, scope: trio.CancelScope) -> None:
            try:
                out[i] = await self.score(out[i])
            except EngineUnavailable as e:  # the group cannot be scored: stop the rest
                lost.append(e)
                scope.cancel()

        async with trio.open_nursery() as nursery:
            for i, sample in enumerate(out):
                if needs_scoring(sample):
                    nursery.start_soon(one, i, nursery.cancel_scope)
        if lost:
            raise lost[0]
        return tuple(out)

    async def score(self, sample: Sample) -> Sample:
        """`sample` with its `teacher_logprobs`, or FAILED (teacher/...); `EngineUnavailable`
        when no teacher engine is left."""
        async with self.limiter:
            try:
                # only the response's positions: the prompt's cost the teacher no LM head, no
                # top-k and no bytes on the wire (SGLang and the built-in engine; vLLM scores the
                # whole sequence and the client keeps those)
                start = sample.prompt_length
                if not self.top_k:
                    served = await self.engines.prompt_logprobs(sample.tokens, start)
                    return dataclasses.replace(
                        sample, teacher_logprobs=response_logprobs(sample, served)
                    )
                served, top = await self.engines.prompt_top_logprobs(
                    sample.tokens, self.top_k, start
                )
                if len(top) != sample.response_length:
                    raise EngineError(
                        f"the teacher returned {len(top)} top-k positions for a response of "
                        f"{sample.response_length} tokens"
                    )
                return dataclasses.replace(
                    sample,
                    teacher_logprobs=response_logprobs(sample, served),
                    teacher_top=tuple(top),
                )
            except EngineUnavailable:
                raise
            except EngineError as e:
                error = f"the teacher's engine failed: {type(e).__name__}: {e}"
                return mark_failed(sample, error, "teacher/engine_error")


def needs_scoring(sample: Sample) -> bool:
    """A finished sample with a response and no teacher logprobs yet."""
    return sample.status in SCORED and sample.response_length > 0 and not sample.teacher_logprobs
