"""One agent episode as one token sequence: the record a session keeps, and its pure rules.

An episode's first call is rendered whole (the prompt, mask 0). A later call must extend the
conversation the gateway recorded: the earlier messages, then the assistant message the gateway
returned (compared by meaning: `wire.same_message`), then new messages. Only the new messages
are rendered (the template's text appended after the sampled tokens, checked append-only), so
the sampled tokens stay exactly as sampled (mask 1, their logprobs) and everything else is mask
0. A call that edits or drops earlier turns cannot be one sequence and is refused (400).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from rollouts.data.sft import encode
from rollouts.envs.tool_format import ToolSpec, render_with_tools
from rollouts.gateway.wire import ChatRequest, GatewayError, same_message
from rollouts.wire.generation import Completion, FinishReason


class Ending(enum.Enum):
    """Why a session takes no more calls."""

    DROPPED = "dropped"  # the engine aborted a call (surplus sample, or a sync in abort mode)
    FAILED = "failed"  # a call timed out, or the engines failed
    TRUNCATED = "truncated"  # a bound: rollout.gateway.max_calls or rollout.max_total_tokens


@dataclasses.dataclass(kw_only=True, slots=True)
class Episode:
    """The mutable record of one episode (its session's alone; one call at a time)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as the agent sees
    rendered: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as the model does
    text: str = ""  # the rendered text so far (sampled turns as sampled)
    tools: tuple[ToolSpec, ...] | None = None  # fixed by the first call
    prompt_length: int = 0
    calls: int = 0
    tool_calls: int = 0
    ending: Ending | None = None
    reason: str = ""  # why it ended, for the agent's later calls and the sample
    # the agent loop's name for a bound that ended it (`loop/episodes.EPISODE_ENDS`): "max_turns"
    # (rollout.gateway.max_calls) or "context" (rollout.max_total_tokens); "" otherwise
    bound: str = ""

    def end(self, ending: Ending, reason: str, bound: str = "") -> None:
        """No more calls: the first ending stays."""
        if self.ending is None:
            self.ending, self.reason, self.bound = ending, reason, bound


def new_messages(episode: Episode, request: ChatRequest) -> list[dict[str, Any]]:
    """The messages `request` adds to the episode; a 400 when it does not extend it."""
    if episode.tools is not None and request.tools != episode.tools:
        raise GatewayError(
            400,
            "tools: differ from this episode's first call; the tools are part of the prompt the "
            "episode's tokens start with: send the same tools on every call",
            param="tools",
        )
    kept = episode.messages
    sent = request.messages
    if len(sent) <= len(kept):
        raise GatewayError(
            400,
            f"messages: {len(sent)} message(s), the episode already holds {len(kept)}; a call "
            "must send the whole conversation so far plus at least one new message",
            param="messages",
        )
    for i, (s, k) in enumerate(zip(sent, kept, strict=False)):
        if not same_message(s, k):
            raise GatewayError(
                400,
                f"messages[{i}] ({s['role']}) differs from the conversation recorded so far "
                f"({k['role']}: {str(k.get('content'))[:60]!r}); an episode is one token "
                "sequence, so a call may only append messages: keep earlier turns, and the "
                "assistant messages returned, unchanged (start a new episode to edit history)",
                param=f"messages[{i}]",
            )
    return [dict(m) for m in sent[len(kept) :]]


def prompt_text(
    tokenizer: Any, episode: Episode, added: Sequence[dict[str, Any]], tools: Sequence[ToolSpec]
) -> str:
    """The template's text for `added` plus the generation header, after what is rendered."""
    full = render_with_tools(tokenizer, [*episode.rendered, *added], tools, True)
    if not full.startswith(episode.text):
        raise GatewayError(
            400,
            "messages: the chat template rewrites earlier text when these messages are added "
            f"(the render no longer starts with {episode.text[-40:]!r}); the gateway records an "
            "episode as one sequence and needs an append-only template",
            param="messages",
        )
    return full[len(episode.text) :]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """A sampled turn: the engine's completion, its text as sampled and as the agent gets it."""

    completion: Completion
    raw_text: str  # decoded with special tokens: what the template sees again
    message: dict[str, Any]  # the assistant message returned to the agent


def commit(
    episode: Episode,
    tools: tuple[ToolSpec, ...],
    added: Sequence[dict[str, Any]],
    added_text: str,
    added_ids: Sequence[int],
    turn: Turn,
    raw_content: str,
) -> None:
    """Append one finished call: the new messages' tokens (mask 0), then the sampled ones
    exactly (mask 1, with their logprobs), and the weight version that made them."""
    c = turn.completion
    assert c.finish_reason is not FinishReason.ABORT, "an aborted call is never recorded"
    assert len(c.output_ids) == len(c.logprobs), f"{len(c.output_ids)=} != {len(c.logprobs)=}"
    first = not episode.tokens
    episode.tokens += added_ids
    episode.mask += [0] * len(added_ids)
    episode.logprobs += [0.0] * len(added_ids)
    if first:
        episode.prompt_length, episode.tools = len(added_ids), tools
    episode.tokens += c.output_ids
    episode.mask += [1] * len(c.output_ids)
    episode.logprobs += c.logprobs
    if c.output_ids and (not episode.versions or episode.versions[-1] != c.weight_version):
        episode.versions.append(c.weight_version)
    episode.text += added_text + turn.raw_text
    episode.messages += [*added, turn.message]
    episode.rendered += [*added, {"role": "assistant", "content": raw_content}]
    episode.calls += 1
    episode.tool_calls += len(turn.message.get("tool_calls") or ())
    assert len(episode.tokens) == len(episode.mask), f"{len(episode.tokens)=} != mask"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template text (never of sampled text, which is kept as sampled)."""
    return encode(tokenizer, text) if text else []
