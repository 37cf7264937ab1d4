"""Tool calls: parse them from model text (JSON and XML styles), run them against a cost budget.

JSON style:  <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>
XML style:   <calculator><expression>2+3</expression></calculator>   (only for known tool names)

A malformed call is reported as a `ToolCall` with `error` set, never silently skipped, so the
environment can answer with the error and count it as an invalid action.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollouts.envs.threads import CallTimeout, call_from_thread

_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_ARG = re.compile(r"<(\w+)>(.*?)</\1>", re.DOTALL)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One parsed call; `error` is set when the text looked like a call but could not be read."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    style: str = "json"  # "json" | "xml"
    error: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tool:
    """A callable tool (sync or `async def`) with a cost charged against the episode's budget on
    every call, and a timeout: a call that overruns it fails the sample (`CallTimeout`)."""

    name: str
    fn: Callable[..., Any]
    cost: float = 1.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        assert self.cost >= 0.0, f"{self.name}: {self.cost=} must be >= 0"
        assert self.timeout_s > 0.0, f"{self.name}: {self.timeout_s=} must be > 0"


def _parse_json_call(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"tool call is not valid JSON: {e.msg}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(name="", error='tool call JSON needs a string "name"')
    args = data.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name=data["name"], error="tool call arguments are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(name=data["name"], error="tool call arguments must be an object")
    return ToolCall(name=data["name"], arguments=args)


def parse_tool_calls(text: str, tool_names: Iterable[str] = ()) -> list[ToolCall]:
    """Every tool call in `text`, in order: JSON `<tool_call>` blocks, then XML blocks of tools."""
    calls = [_parse_json_call(m.group(1)) for m in _JSON_CALL.finditer(text)]
    rest = _JSON_CALL.sub("", text)
    for name in tool_names:
        pattern = re.compile(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", re.DOTALL)
        for m in pattern.finditer(rest):
            args = {k: v.strip() for k, v in _XML_ARG.findall(m.group(1))}
            if not args and m.group(1).strip():
                args = {"input": m.group(1).strip()}
            calls.append(ToolCall(name=name, arguments=args, style="xml"))
    return calls


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """What running one call gave: the text for the model and what it cost."""

    call: ToolCall
    output: str
    cost: float
    ok: bool
    over_budget: bool = False


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool], budget_left: float) -> ToolResult:
    """Run `call` if it is valid and affordable; otherwise an error result (cost 0).

    On a runner's worker thread (a sync `env.step` run by the agent loop) the tool runs in its
    own thread under `tool.timeout_s` (an async tool is awaited); an overrun raises
    `CallTimeout`, which fails the sample rather than answering the model.
    """
    if call.error:
        return ToolResult(call=call, output=f"error: {call.error}", cost=0.0, ok=False)
    tool = tools.get(call.name)
    if tool is None:
        known = sorted(tools)
        return ToolResult(
            call=call,
            output=f"error: unknown tool {call.name!r}; tools: {known}",
            cost=0.0,
            ok=False,
        )
    if tool.cost > budget_left:
        return ToolResult(
            call=call,
            output=f"error: tool budget exhausted ({budget_left:g} "
            f"left, {call.name} costs {tool.cost:g})",
            cost=0.0,
            ok=False,
            over_budget=True,
        )
    try:
        fn = functools.partial(tool.fn, **call.arguments)
        output = call_from_thread(f"tool {call.name}", tool.timeout_s, fn)
    except CallTimeout:
        raise
    except Exception as e:  # a tool error is an observation for the model, not a crash
        return ToolResult(
            call=call, output=f"error: {type(e).__name__}: {e}", cost=tool.cost, ok=False
        )
    return ToolResult(call=call, output=str(output), cost=tool.cost, ok=True)
