"""Message trajectories and tokens: incremental rendering, `trajectory_to_sample`, and the sample
an episode's token record makes (`record_to_sample`, for the agent loop and the gateway alike).

The agent loop keeps the model's sampled tokens exactly and appends only what the chat template
adds around them, rendered one step at a time. `ChatRenderer` does that bookkeeping and fails
loudly (`TemplateError`) when a template rewrites text it has already rendered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rollouts.data.sft import TemplateError, encode, render, tokenize_conversation
from rollouts.envs.tool_format import inline_tool_calls
from rollouts.types import Message, Sample, Status


class ChatRenderer:
    """The rendered text of a growing conversation; each step returns only the new text."""

    def __init__(self, tokenizer: Any, template_args: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_args = dict(template_args or {})  # e.g. `tools`, for every render
        self.text = ""

    def extend(self, messages: Sequence[Message], add_generation_prompt: bool, where: str) -> str:
        """Render `messages`; return the text added since the last render (append-only check)."""
        full = render(self.tokenizer, messages, add_generation_prompt, **self.template_args)
        if not full.startswith(self.text):
            raise TemplateError(rewrite_message(self.text, full, where))
        added, self.text = full[len(self.text) :], full
        return added

    def generated(self, text: str) -> None:
        """Record text the model produced (its tokens are kept as sampled, not re-encoded)."""
        self.text += text


def rewrite_message(before: str, after: str, where: str) -> str:
    """What a TemplateError says: where the new render departs from the text already in tokens,
    both sides of it, and what to do."""
    at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), None)
    at = min(len(before), len(after)) if at is None else at
    return (
        f"chat template is not append-only at {where}: rendering the conversation again "
        f"rewrote text already turned into tokens, at character {at}: it was "
        f"{before[max(0, at - 30) : at + 40]!r}, the template now writes "
        f"{after[max(0, at - 30) : at + 40]!r}. The episode's tokens would not be what the "
        "model saw, so it fails; the multi-turn loop needs a template that only appends "
        "(e.g. Qwen3's drops earlier turns' <think> blocks once a user message follows: "
        "answer with `tool` messages, or use a template that keeps them)"
    )


def trajectory_to_sample(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    index: int = 0,
    group_index: int = 0,
    label: Any = None,
    status: Status = Status.COMPLETED,
    train_roles: Sequence[str] = ("assistant",),
    metadata: Mapping[str, Any] | None = None,
) -> Sample:
    """A Sample from a message trajectory: assistant turns trained, everything else masked.

    The prompt is every message before the first trained turn; the response is the rest
    (observations and tool outputs included, with loss_mask 0). Tool calls in a `tool_calls`
    field are inlined into the content first. No rollout logprobs (not known from messages).
    """
    msgs = [inline_tool_calls(m) if m.get("tool_calls") else dict(m) for m in messages]
    first = next((i for i, m in enumerate(msgs) if m["role"] in train_roles), None)
    if first is None or first == 0:
        raise ValueError(
            f"trajectory needs prompt message(s) before the first {list(train_roles)} turn; "
            f"roles: {[m['role'] for m in msgs]}"
        )
    tokens, mask = tokenize_conversation(tokenizer, msgs, train_roles)
    # the prompt ends where the first trained token starts (as tokenize_conversation cut it)
    prompt_len = (
        mask.index(1)
        if 1 in mask
        else len(encode(tokenizer, render(tokenizer, msgs[:first], True)))
    )
    assert prompt_len <= len(tokens), f"{prompt_len=} > {len(tokens)=}"
    assert not any(mask[:prompt_len]), "a prompt token is marked trained"
    return Sample(
        index=index,
        group_index=group_index,
        prompt=tuple(msgs[:first]),
        label=label,
        tokens=tuple(tokens),
        loss_mask=tuple(mask),
        response_length=len(tokens) - prompt_len,
        status=status,
        metadata={"messages": msgs, **(metadata or {})},
    )


class TokenRecord(Protocol):
    """An episode's tokens as generated, prompt first: the agent loop's trajectory and the
    gateway's `Episode` each keep one."""

    tokens: list[int]
    mask: list[int]  # 1 on the model's sampled tokens, 0 on the prompt and on fixed text
    logprobs: list[float]  # one per token (0.0 where not sampled)
    versions: list[str]  # the policy versions that sampled it


def record_to_sample(
    sample: Sample,
    record: TokenRecord,
    *,
    prompt_length: int,
    status: Status,
    metadata: Mapping[str, Any],
) -> Sample:
    """`sample` holding the episode `record`: every token, the loss mask, the logprobs of what
    follows the prompt and the weight versions."""
    assert len(record.tokens) == len(record.mask), f"{len(record.tokens)=} != {len(record.mask)=}"
    assert not any(record.mask[:prompt_length]), "a prompt token is marked trained"
    return dataclasses.replace(
        sample,
        tokens=tuple(record.tokens),
        loss_mask=tuple(record.mask),
        response_length=len(record.tokens) - prompt_length,
        rollout_logprobs=tuple(record.logprobs[prompt_length:]),
        weight_versions=tuple(record.versions),
        status=status,
        metadata=metadata,
    )


def without_tokens(sample: Sample) -> Sample:
    """`sample` with nothing generated: no tokens (the prompt's neither), mask, logprobs (the
    teacher's too) or weight versions; its status, reward and metadata as they were."""
    return dataclasses.replace(
        sample,
        tokens=(),
        loss_mask=(),
        response_length=0,
        rollout_logprobs=(),
        weight_versions=(),
        teacher_logprobs=(),
        teacher_top=(),
    )
