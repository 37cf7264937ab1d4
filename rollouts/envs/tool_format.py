"""Tools in a model's own chat template: how the tools reach the prompt, how a call is written.

One format, shared by the multi-turn environments, the SFT traces and the OpenAI-compatible
gateway, so that what a model is trained to write is what every reader parses:

- The tools reach the model through the template's own `tools` argument when the template renders
  it (Qwen2.5, Llama 3.1, Hermes...). A template that ignores `tools` (SmolLM2's plain ChatML) gets
  them in the system message instead (`tool_system_text`), appended to the one the conversation
  has, or as a system message of its own.
- A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes style,
  which vLLM's `hermes` tool parser reads); `call_text` writes it, `split_tool_calls` reads it.
- A tool's result goes back as a `{"role": "tool", "content": ...}` message rendered by the
  template. Assistant messages with a `tool_calls` field are written into their content first
  where the template does not render `tool_calls` itself.
- A server that renders the prompt itself (vLLM's OpenAI server) gets the same prompt from a
  packaged template that writes `tools` and `tool_calls` this way (`packaged_template`:
  `smollm2_tools` for SmolLM2, passed as `--chat-template`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollouts.data.sft import render
from rollouts.envs.tools import ToolCall, parse_tool_calls
from rollouts.types import Message

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_TEMPLATES = Path(__file__).parent / "templates"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolSpec:
    """One tool as the model sees it: a name, what it does, its arguments as JSON Schema."""

    name: str
    description: str
    parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def __post_init__(self) -> None:
        assert self.name and self.name.isidentifier(), f"tool name {self.name!r}: an identifier"
        assert self.parameters.get("type") == "object", f"{self.name}: parameters must be an object"

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI `tools` entry (`{"type": "function", "function": {...}}`)."""
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"a tool needs function.name: {dict(tool)!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        return cls(name=fn["name"], description=str(fn.get("description", "")), parameters=params)

    def to_openai(self) -> dict[str, Any]:
        """As an OpenAI `tools` entry (what templates that render tools take)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of one call, exactly as a model writes it (and is trained to)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CALL_CLOSE}"


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls in order); malformed calls carry `error`."""
    at = text.find(CALL_OPEN)
    content = text if at < 0 else text[:at]
    return content.strip(), parse_tool_calls(text)


def tool_system_text(tools: Sequence[ToolSpec]) -> str:
    """The tools described in words, for a system message (templates that ignore `tools`)."""
    assert tools, "no tools to describe"
    lines = "\n".join(json.dumps(t.to_openai()["function"]) for t in tools)
    return (
        "You can use these tools, given as JSON function signatures:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call a tool, write one line per call, exactly like this:\n"
        f'{CALL_OPEN}{{"name": "tool_name", "arguments": {{"arg": "value"}}}}{CALL_CLOSE}\n'
        "Each result comes back in a message from the tool. When you have the answer, reply "
        "without a tool call."
    )


_PROBE_TOOL = ToolSpec(name="rollouts_probe_tool", description="probe")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TemplateTools:
    """What a chat template does with tools: renders `tools`, renders `tool_calls`."""

    tools: bool
    tool_calls: bool


def _try_render(tokenizer: Any, messages: list[dict[str, Any]], **extra: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **extra)
    except Exception:  # a template that fails on these fields does not render them
        return ""


@functools.cache
def _probe(template: str, tokenizer: Any) -> TemplateTools:
    user = [{"role": "user", "content": "hi"}]
    call = {"type": "function", "function": {"name": _PROBE_TOOL.name, "arguments": "{}"}}
    asked = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with_tools = _try_render(tokenizer, user, tools=[_PROBE_TOOL.to_openai()])
    return TemplateTools(
        tools=_PROBE_TOOL.name in with_tools,
        tool_calls=_PROBE_TOOL.name in _try_render(tokenizer, asked),
    )


def template_tools(tokenizer: Any) -> TemplateTools:
    """What the tokenizer's chat template writes of `tools` and of an assistant's `tool_calls`."""
    return _probe(str(tokenizer.chat_template), tokenizer)


def with_tools(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSpec]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template arguments) that put `tools` before the model.

    The template's `tools` where it renders them; otherwise the tools' description joins the
    system message (a new first message when the conversation has none).
    """
    msgs = [dict(m) for m in messages]
    if not tools:
        return msgs, {}
    if template_tools(tokenizer).tools:
        return msgs, {"tools": [t.to_openai() for t in tools]}
    text = tool_system_text(tools)
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"{msgs[0]['content']}\n\n{text}"
    else:
        msgs.insert(0, {"role": "system", "content": text})
    return msgs, {}


def inline_tool_calls(message: Message) -> dict[str, Any]:
    """An assistant message whose `tool_calls` field is written into its content.

    For templates that do not render `tool_calls` themselves (SmolLM2's, the tiny ChatML one), so
    the calls the model made are part of the text, as the model wrote them.
    """
    out = dict(message)
    calls = out.pop("tool_calls", None) or []
    parts = [out.get("content") or ""]
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        parts.append(call_text(fn["name"], json.loads(args) if isinstance(args, str) else args))
    out["content"] = "".join(parts)
    return out


def render_with_tools(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    add_generation_prompt: bool,
) -> str:
    """The conversation as the model sees it, tools included (see `with_tools`)."""
    msgs, extra = with_tools(tokenizer, messages, tools)
    if not template_tools(tokenizer).tool_calls:
        msgs = [inline_tool_calls(m) if m.get("tool_calls") else m for m in msgs]
    return render(tokenizer, msgs, add_generation_prompt, **extra)


def packaged_template(name: str) -> Path:
    """The chat template `name` shipped with rollouts (envs/templates/NAME.jinja).

    `smollm2_tools`: SmolLM2's template that renders `tools` and `tool_calls` exactly as
    `render_with_tools` does for SmolLM2's own, for a server's `--chat-template` (vLLM's).
    """
    path = _TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in _TEMPLATES.glob("*.jinja"))
        raise FileNotFoundError(f"no packaged chat template {name!r}; known: {known}")
    return path
