"""The packaged SmolLM2 template with tools (envs/templates/smollm2_tools.jinja) renders what the
agent loop renders with SmolLM2's own template (`render_with_tools`), so a server that applies it
(vLLM's, `--chat-template`) builds the prompt the loop and the gateway build."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollouts.envs.shop import shop_tool_specs
from rollouts.envs.tool_format import ToolSpec, packaged_template, render_with_tools

SHOP = shop_tool_specs()
UNICODE = ToolSpec(name="note", description="Écrit une note, «vite»")


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call as an OpenAI client sends it back (arguments as a JSON string)."""
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{name}", "type": "function", "function": fn}


def _parsed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a template: call arguments parsed into objects."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


QUESTION = {"role": "user", "content": "What do 7 units of lamp cost?"}
EPISODE = [
    {"role": "system", "content": "Answer questions about a shop with its tools."},
    QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [_call("lookup", {"item": "lamp"})]},
    {"role": "tool", "tool_call_id": "call_lookup", "content": '{"price": 12, "stock": 40}'},
    {
        "role": "assistant",
        "content": "Now the product.",
        "tool_calls": [
            _call("calculator", {"expression": "7 * 12"}),
            _call("note", {"text": "lampe à 12 €", "tags": ["a", {"b": 1}]}),
        ],
    },
    {"role": "tool", "tool_call_id": "call_calculator", "content": "84"},
    {"role": "tool", "tool_call_id": "call_note", "content": "ok"},
    {"role": "assistant", "content": "Answer: 84"},
]
CONVERSATIONS = {
    "system, question": EPISODE[:2],
    "question alone": [QUESTION],
    "whole episode": EPISODE,
    "episode without a system message": EPISODE[1:],
    "episode so far": EPISODE[:4],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("tools", [SHOP, (*SHOP, UNICODE), ()], ids=["shop", "unicode", "none"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_template_renders_what_the_loop_renders(
    tokenizer: Any, name: str, tools: tuple[ToolSpec, ...], add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = render_with_tools(tokenizer, messages, tools, add_generation_prompt)
    theirs = tokenizer.apply_chat_template(
        _parsed(messages),
        tools=[t.to_openai() for t in tools] or None,
        chat_template=packaged_template("smollm2_tools").read_text(),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert theirs == ours
    if tools:
        assert '"name": "lookup"' in theirs.split("<|im_start|>user")[0]  # in the system message


def test_without_tools_it_is_smollm2s_own_template(tokenizer: Any) -> None:
    template = packaged_template("smollm2_tools").read_text()
    for messages in ([QUESTION], EPISODE[:2], [*EPISODE[:2], EPISODE[-1]]):
        own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        packaged = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert packaged == own


def test_an_unknown_template_names_the_known_ones() -> None:
    with pytest.raises(FileNotFoundError, match="smollm2_tools"):
        packaged_template("nope")
