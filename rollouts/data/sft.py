"""Tokenise conversations with loss masks taken from the chat template.

The conversation is rendered one message at a time; each render must extend the previous one
(append-only templates), otherwise `TemplateError` is raised, because a template that rewrites
earlier turns makes the tokens the model was trained on differ from the ones it sees at
generation time (verl #6501, slime #1563). Assistant content up to and including the template's
end-of-turn marker is trained (mask 1); headers, other roles and whatever the template puts after
the marker are not (mask 0). The marker is read from the template itself (`end_of_turn`), not
taken to be `eos_token`: they differ in base models such as Qwen2.5 (eos `<|endoftext|>`, turns
end with `<|im_end|>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollouts.types import Message


class TemplateError(ValueError):
    """The chat template is not append-only for this conversation."""


def render(
    tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool, **extra: Any
) -> str:
    """The chat template applied to `messages`, as text (`extra`: template arguments, `tools`)."""
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
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


_PROBE = "\u2063rollouts-end-of-turn-probe\u2063"


def end_of_turn(tokenizer: Any) -> str:
    """The text the chat template puts right after an assistant message's content.

    Rendered from a user + assistant conversation: the special (added) token the template writes
    after the content, e.g. `<|im_end|>` for ChatML; `eos_token` when the template ends turns
    with it; "" when it writes neither (nothing after the content is trained then).
    """
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = render(tokenizer, probe, add_generation_prompt=False)
    assert _PROBE in text, f"the chat template dropped the assistant content: {text[-80:]!r}"
    after = text[text.rindex(_PROBE) + len(_PROBE) :]
    specials = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    marker = next((t for t in specials if t and after.startswith(t)), "")
    eos = tokenizer.eos_token or ""
    return marker or (eos if eos and after.startswith(eos) else "")


def _trained_span(tokenizer: Any, body: str) -> tuple[list[int], list[int]]:
    """Tokens of an assistant body; mask 1 through the end-of-turn marker, 0 after it."""
    eos = end_of_turn(tokenizer)
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
