"""The seams of rollout generation: the generate function and the group filter.

A generate function turns one PENDING (or ABORTED, partially generated) sample into a finished
one. The default one calls the engine once; the multi-turn agent loop is just another generate
function. Either may be `async def` or plain `def` (a sync one runs in a worker thread).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from rollouts.envs.protocol import EnvFactory
from rollouts.envs.threads import ThreadRunner
from rollouts.inference.protocol import InferenceEngine
from rollouts.types import Sample
from rollouts.wire.generation import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerateContext:
    """Everything a generate function may use for one sample.

    `engine` is an InferenceEngine (a single client or the EnginePool); `rid` is the request id
    to send with the sample's requests (the manager aborts by it); `sampling` already has the
    run's `max_new_tokens`; `max_total_tokens` bounds prompt + response (multi-turn included).
    `threads` runs blocking user code (environments, tools) with `env_timeout_s` per call.
    """

    engine: InferenceEngine
    tokenizer: Any
    sampling: SamplingParams
    rid: str
    max_total_tokens: int = 1024
    max_turns: int = 1
    env_factory: EnvFactory | None = None
    mask_off_policy_partial: bool = False
    threads: ThreadRunner | None = None  # None = a runner of its own per call
    env_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        assert self.max_total_tokens >= 1, f"{self.max_total_tokens=} must be >= 1"
        assert self.env_timeout_s > 0, f"{self.env_timeout_s=} must be > 0"
        assert self.max_turns >= 1, f"{self.max_turns=} must be >= 1"


class GenerateFn(Protocol):
    """`(sample, ctx) -> Sample`, async or sync.

    Returns the sample with `tokens` (prompt + response), `loss_mask`, `response_length`,
    `rollout_logprobs`, `weight_versions` (one appended per engine call that produced tokens) and
    a finished `status` (ABORTED when the engine aborted it: the manager resumes it later).
    Raising marks the sample FAILED; it is counted and reported, never scored.
    """

    def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample | Awaitable[Sample]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FilterResult:
    """A group filter's verdict: keep, or drop with a short reason (counted per batch)."""

    keep: bool
    reason: str = ""

    def __post_init__(self) -> None:
        assert self.keep or self.reason, "a dropped group needs a reason"


class GroupFilter(Protocol):
    """`(group) -> FilterResult | bool` over a scored group of samples (pure, sync)."""

    def __call__(self, group: Sequence[Sample]) -> FilterResult | bool: ...
