"""Tokenise conversations with loss masks taken from the chat template.

The conversation is rendered one message at a time; each render must extend the previous one
(append-only templates), otherwise `TemplateError` is raised, because a template that rewrites
earlier turns makes the tokens the model was trained on differ from the ones it sees at
generation time (verl #6501, slime #1563). Assistant content up to and including the EOS token is
trained (mask 1); headers, other roles and whatever the template puts after EOS are not (mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollouts.types import Message


class TemplateError(ValueError):
    """The chat template is not append-only for this conversation."""


def render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The chat template applied to `messages`, as text."""
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, with no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _extension(prev: str, text: str, where: str) -> str:
    if not text.startswith(prev):
        raise TemplateError(
            f"chat template is not append-only at {where}: rendering more messages changed the "
            f"earlier text (expected it to start with {prev[-40:]!r}); use an append-only template"
        )
    return text[len(prev) :]


def _trained_span(tokenizer: Any, body: str) -> tuple[list[int], list[int]]:
    """Tokens of an assistant body; mask 1 through the first EOS string, 0 after it."""
    eos = tokenizer.eos_token or ""
    cut = body.find(eos) + len(eos) if eos and eos in body else len(body)
    trained, rest = encode(tokenizer, body[:cut]), encode(tokenizer, body[cut:])
    return trained + rest, [1] * len(trained) + [0] * len(rest)


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[Message], train_roles: Sequence[str] = ("assistant",)
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = trained) of a whole conversation, built incrementally."""
    assert messages, "a conversation needs at least one message"
    tokens: list[int] = []
    mask: list[int] = []
    prev = ""
    for i, message in enumerate(messages):
        where = f"message {i} ({message['role']})"
        if message["role"] in train_roles:
            header_text = render(tokenizer, messages[:i], add_generation_prompt=True)
            header = _extension(prev, header_text, where)
            full = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
            body = _extension(header_text, full, where)
            ids = encode(tokenizer, header)
            tokens += ids
            mask += [0] * len(ids)
            body_ids, body_mask = _trained_span(tokenizer, body)
            tokens += body_ids
            mask += body_mask
        else:
            full = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
            ids = encode(tokenizer, _extension(prev, full, where))
            tokens += ids
            mask += [0] * len(ids)
        prev = full
    assert len(tokens) == len(mask), f"{len(tokens)=} != {len(mask)=}"
    return tokens, mask


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[Message]) -> list[int]:
    """Token ids of an RL prompt: chat messages get the generation prompt; text is used as is."""
    if isinstance(prompt, str):
        return encode(tokenizer, prompt)
    return encode(tokenizer, render(tokenizer, prompt, add_generation_prompt=True))
