"""Multi-turn dialogue: the environment plays the user, scripted or played by a model.

`ConversationEnvironment(user)` answers each assistant turn with the user's next message. The
user is one of:
- a list of user turns, said in order; the conversation ends after the last;
- a function `(history) -> str | UserReply | None` (None ends the conversation);
- an async function of the same shape, e.g. `ModelUser`, a model that plays the user through an
  engine (an InferenceEngine). Then `step` returns an awaitable, which the agent loop awaits.

`history` is the conversation so far as chat messages (the sample's prompt first). A user may
return a `UserReply` to add per-step signals (`step_reward`, `success`, ...) to the step's info.
The number of user turns is bounded by `max_user_turns`. The agent loop steps the environment
after every assistant turn, the last one too: with `max_user_turns = rollout.max_turns - 1` the
dialogue ends there, and no user reply is generated that nobody would read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import trio

from rollouts.data.sft import encode, render
from rollouts.plugins import is_async_callable
from rollouts.types import Message, Sample
from rollouts.wire.generation import Completion, FinishReason, SamplingParams

StepResult = tuple[str, bool, Mapping[str, Any]]


class Generates(Protocol):
    """What a model-played user asks of an engine: one generation (an `InferenceEngine`, the
    `EnginePool` among them, has it)."""

    url: str

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """One continuation of `input_ids`."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UserReply:
    """The user's next message (None ends the conversation) and signals for the step's info."""

    message: str | None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


UserOutput = str | UserReply | None
UserFn = Callable[[Sequence[Message]], UserOutput | Awaitable[UserOutput]]


def prompt_messages(sample: Sample | None) -> list[dict[str, Any]]:
    """The sample's prompt as chat messages (a text prompt is one user message)."""
    if sample is None:
        return []
    if isinstance(sample.prompt, str):
        return [{"role": "user", "content": sample.prompt}]
    return [dict(m) for m in sample.prompt]


class ConversationEnvironment:
    """The user's side of a dialogue; sync `step` for sync users, awaitable for async ones."""

    def __init__(
        self, user: Sequence[str] | UserFn, sample: Sample | None = None, max_user_turns: int = 8
    ) -> None:
        assert max_user_turns >= 0, f"{max_user_turns=} must be >= 0"
        assert not isinstance(user, str), f"user={user!r}: give a list of turns, not one string"
        self.script = tuple(user) if isinstance(user, Sequence) else None
        self.user: UserFn = self._scripted if isinstance(user, Sequence) else user
        assert callable(self.user), f"user must be a list of turns or callable, got {user!r}"
        self.is_async = is_async_callable(self.user)
        self.prompt = prompt_messages(sample)
        self.max_user_turns = max_user_turns
        self.history: list[dict[str, Any]] = []
        self.user_turns = 0

    def _scripted(self, history: Sequence[Message]) -> str | None:
        assert self.script is not None
        return self.script[self.user_turns] if self.user_turns < len(self.script) else None

    def reset(self) -> str:
        self.history, self.user_turns = list(self.prompt), 0
        return ""

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        self.history.append({"role": "assistant", "content": action})
        if self.user_turns >= self.max_user_turns:
            return self._answer(UserReply(message=None, info={"ended_by": "max_user_turns"}))
        if self.is_async:
            return self._step_async()
        return self._answer(self.user(tuple(self.history)))  # type: ignore[arg-type]

    async def _step_async(self) -> StepResult:
        return self._answer(await self.user(tuple(self.history)))  # type: ignore[misc]

    def _answer(self, out: UserOutput) -> StepResult:
        reply = out if isinstance(out, UserReply) else UserReply(message=out)
        if reply.message is not None and not isinstance(reply.message, str):
            raise TypeError(f"user returned {reply.message!r}: expected str, UserReply or None")
        if reply.message is None:
            info = {"role": "user", "user_turns": self.user_turns, "ended_by": "user"}
            return "", True, {**info, **reply.info}
        self.history.append({"role": "user", "content": reply.message})
        self.user_turns += 1
        return reply.message, False, {"role": "user", "user_turns": self.user_turns, **reply.info}


def conversation_env(user: Sequence[str] | UserFn, max_user_turns: int = 8) -> Callable[..., Any]:
    """An EnvFactory `(sample) -> ConversationEnvironment` with the same user for every sample."""

    def factory(sample: Sample) -> ConversationEnvironment:
        return ConversationEnvironment(user, sample, max_user_turns)

    return factory


def user_view(history: Sequence[Message], persona: str) -> list[dict[str, Any]]:
    """The conversation as the user model sees it: roles swapped, its persona as the system."""
    swap = {"user": "assistant", "assistant": "user"}
    view = [{"role": "system", "content": persona}] if persona else []
    for m in history:
        if m["role"] in swap:
            view.append({"role": swap[m["role"]], "content": m["content"]})
    return view


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelUser:
    """A model that plays the user: async `(history) -> str | None` through an engine.

    It sees the dialogue with roles swapped (`user_view`) and answers as "assistant"; saying
    `end_marker` ends the conversation. Every request is bounded by `timeout_s`; an aborted or
    failed generation is an error (the sample is marked FAILED), never an empty message.
    """

    engine: Generates
    tokenizer: Any
    persona: str = "You are a user talking to an assistant. Say [END] when you are done."
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    end_marker: str = "[END]"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        assert self.timeout_s > 0, f"{self.timeout_s=} must be > 0"

    async def __call__(self, history: Sequence[Message]) -> str | None:
        text = render(self.tokenizer, user_view(history, self.persona), True)
        ids = encode(self.tokenizer, text)
        with trio.fail_after(self.timeout_s):
            completion = await self.engine.generate(ids, self.sampling)
        if completion.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise RuntimeError(
                f"the user model's generation ended with {completion.finish_reason.value} "
                f"({self.engine.url})"
            )
        reply = self.tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)
        if self.end_marker and self.end_marker in reply:
            return None
        return reply.strip()
