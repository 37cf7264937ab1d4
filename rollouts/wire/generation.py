"""The records of one generation, as the run sends and reads them: what every engine client
translates to its server's wire format, and what the built-in engine answers with
(`FinishReason`). The rollout, the gateway and the environments use them without knowing which
engine runs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, get_args

from rollouts.types import Status

# what a pause does to the requests in flight: end them (partial output) | let them finish first |
# freeze them (they go on after the resume, under the new weights)
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)


class FinishReason(enum.Enum):
    """Why generation ended, one enum for every engine."""

    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # aborted (pause in abort mode, abort_request, surplus over-sampling)
    ERROR = "error"

    def to_status(self) -> Status:
        """The Sample status this finish reason gives (slime's mapping)."""
        return _STATUS[self]


_STATUS = {
    FinishReason.STOP: Status.COMPLETED,
    FinishReason.LENGTH: Status.TRUNCATED,
    FinishReason.ABORT: Status.ABORTED,
    FinishReason.ERROR: Status.FAILED,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang names; the vLLM client renames them)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = True  # keep a matched stop string in the output (slime sends true)
    seed: int | None = None

    def __post_init__(self) -> None:
        assert self.max_new_tokens >= 0, f"{self.max_new_tokens=} must be >= 0"
        assert self.temperature >= 0.0, f"{self.temperature=} must be >= 0"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """One generated continuation: exact token ids and the logprob of each sampled token."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    matched_stop: int | str | None = None

    def __post_init__(self) -> None:
        assert len(self.output_ids) == len(self.logprobs), (
            f"{len(self.output_ids)=} != {len(self.logprobs)=}"
        )
        assert self.completion_tokens == len(self.output_ids), (
            f"{self.completion_tokens=} != {len(self.output_ids)=}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    """One prompt of a batch request (`BatchGenerator.generate_many`)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams
    rid: str | None = None

    def __post_init__(self) -> None:
        assert self.input_ids, "input_ids must not be empty"
