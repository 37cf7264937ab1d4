"""Message trajectories and tokens: incremental rendering, and `trajectory_to_sample`.

The agent loop keeps the model's sampled tokens exactly and appends only what the chat template
adds around them, rendered one step at a time. `ChatRenderer` does that bookkeeping and fails
loudly (`TemplateError`) when a template rewrites text it has already rendered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.data.sft import TemplateError, encode, render, tokenize_conversation
from rollouts.envs.tool_format import inline_tool_calls
from rollouts.types import Message, Sample, Status


class ChatRenderer:
    """The rendered text of a growing conversation; each step returns only the new text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""

    def extend(self, messages: Sequence[Message], add_generation_prompt: bool, where: str) -> str:
        """Render `messages`; return the text added since the last render (append-only check)."""
        full = render(self.tokenizer, messages, add_generation_prompt)
        if not full.startswith(self.text):
            raise TemplateError(
                f"chat template is not append-only at {where}: the new render does not start "
                f"with the text already turned into tokens (ends {self.text[-40:]!r}); the "
                "multi-turn loop needs an append-only template"
            )
        added, self.text = full[len(self.text) :], full
        return added

    def generated(self, text: str) -> None:
        """Record text the model produced (its tokens are kept as sampled, not re-encoded)."""
        self.text += text


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
