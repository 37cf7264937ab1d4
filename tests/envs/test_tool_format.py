"""The shared tool format: tools into the prompt per template, calls written and read back."""

from __future__ import annotations

import json

from rollouts.envs.tool_format import (
    ToolSpec,
    call_text,
    render_with_tools,
    split_tool_calls,
    template_tools,
)
from rollouts.models.tiny import train_tokenizer

LOOKUP = ToolSpec(
    name="lookup",
    description="price of an item",
    parameters={"type": "object", "properties": {"item": {"type": "string"}}},
)
ASKED = [
    {"role": "user", "content": "3 pens?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": '{"item": "pen"}'}}
        ],
    },
    {"role": "tool", "content": "12"},
]
RENDERS_TOOLS = (
    "{% if tools %}[T:{% for t in tools %}{{ t.function.name }}{% endfor %}]{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.function.name }}){% endfor %}|{% endfor %}"
)


def test_a_call_is_read_back_as_written() -> None:
    text = "let me look " + call_text("lookup", {"item": "pen"}) + call_text("calc", {"x": "1+2"})
    content, calls = split_tool_calls(text)
    assert content == "let me look"
    assert [(c.name, dict(c.arguments)) for c in calls] == [
        ("lookup", {"item": "pen"}),
        ("calc", {"x": "1+2"}),
    ]
    assert split_tool_calls("<tool_call>{oops</tool_call>")[1][0].error


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    tok = train_tokenizer(["abc"])
    assert template_tools(tok).tools is False
    text = render_with_tools(tok, ASKED, [LOOKUP], add_generation_prompt=True)
    system = text.split("user")[0]
    assert json.dumps(LOOKUP.to_openai()["function"]) in system
    assert call_text("lookup", {"item": "pen"}) in text  # the call inlined in the assistant turn


def test_a_template_that_renders_tools_gets_them_through_its_arguments() -> None:
    tok = train_tokenizer(["abc"])
    tok.chat_template = RENDERS_TOOLS
    assert template_tools(tok).tools and template_tools(tok).tool_calls
    text = render_with_tools(tok, ASKED, [LOOKUP], add_generation_prompt=False)
    assert text.startswith("[T:lookup]user:3 pens?|")
    assert "(call lookup)" in text and "<tool_call>" not in text
