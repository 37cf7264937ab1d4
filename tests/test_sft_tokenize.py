from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.data.sft import TemplateError, tokenize_conversation, tokenize_prompt


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _spans(tok, tokens: list[int], mask: list[int]) -> list[tuple[str, int]]:
    """Group consecutive tokens with the same mask into (text, mask) spans."""
    spans: list[tuple[str, int]] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or mask[i] != mask[start]:
            spans.append((tok.decode(tokens[start:i]), mask[start]))
            start = i
    return spans


def test_multi_turn_masks_exactly_the_assistant_turns(tok) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    tokens, mask = tokenize_conversation(tok, messages)
    assert tok.decode(tokens) == tok.apply_chat_template(messages, tokenize=False)
    assert _spans(tok, tokens, mask) == [
        (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
            "<|im_start|>assistant\n",
            0,
        ),
        ("2<|im_end|>", 1),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4<|im_end|>", 1),
        ("\n", 0),
    ]


def test_tool_turns_are_not_trained(tok) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": "result"},
        {"role": "assistant", "content": "done"},
    ]
    tokens, mask = tokenize_conversation(tok, messages)
    trained = [t for t, m in zip(tokens, mask, strict=True) if m]
    assert tok.decode(trained) == "call<|im_end|>done<|im_end|>"


def test_non_append_only_template_fails_loudly(tok) -> None:
    class Rewriting:
        eos_token = tok.eos_token

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            # drops all but the last message: earlier turns are rewritten away
            return tok.apply_chat_template(messages[-1:], tokenize=False) if messages else ""

        def __call__(self, text, add_special_tokens):
            return tok(text, add_special_tokens=add_special_tokens)

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(TemplateError, match="not append-only at message 1"):
        tokenize_conversation(Rewriting(), messages)


def test_prompt_tokens_end_with_generation_prompt(tok) -> None:
    ids = tokenize_prompt(tok, ({"role": "user", "content": "hi"},))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(tokenize_prompt(tok, "3+4=")) == "3+4="
