"""Built-in environments and tool-call parsing."""

from __future__ import annotations

import pytest

from rollouts.envs import (
    Environment,
    SingleTurnEnvironment,
    TextGameEnvironment,
    calculator_env,
    parse_tool_calls,
    resolve_env_factory,
    self_verify_env,
)
from rollouts.envs.builtin import calculate
from rollouts.envs.tools import Tool, ToolCall, run_tool_call
from rollouts.types import Sample

SAMPLE = Sample(index=0, group_index=0, prompt="p", label="42")


def test_parse_json_and_xml_tool_calls() -> None:
    text = (
        'a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> '
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        "<calculator><expression>3*4</expression></calculator> <verify>7</verify>"
        "<tool_call>{oops}</tool_call>"
    )
    calls = parse_tool_calls(text, ["calculator", "verify"])
    assert calls[0] == ToolCall(name="calculator", arguments={"expression": "1+2"})
    assert calls[1] == ToolCall(name="f", arguments={"x": 1})
    assert calls[2].error.startswith("tool call is not valid JSON")
    assert calls[3] == ToolCall(name="calculator", arguments={"expression": "3*4"}, style="xml")
    assert calls[4] == ToolCall(name="verify", arguments={"input": "7"}, style="xml")
    assert parse_tool_calls("no calls <foo>1</foo>", ["calculator"]) == []


def test_calculator_is_safe_and_exact() -> None:
    assert calculate("2+3*4") == "14"
    assert calculate("7/2") == "3.5"
    for bad in ("__import__('os')", "2**1000", "x+1"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_tool_budget_is_enforced_per_call_cost() -> None:
    tools = {"t": Tool(name="t", fn=lambda: "ok", cost=1.5)}
    assert run_tool_call(ToolCall(name="t"), tools, 2.0).ok
    refused = run_tool_call(ToolCall(name="t"), tools, 1.0)
    assert refused.over_budget
    assert refused.cost == 0.0
    assert "unknown tool" in run_tool_call(ToolCall(name="u"), tools, 9.0).output

    env = calculator_env(SAMPLE, budget=2.0)
    assert isinstance(env, Environment)
    env.reset()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    obs, done, info = env.step(call)
    assert (obs, done, info["role"], info["tool_cost"]) == ("42", False, "tool", 1.0)
    obs, done, info = env.step(call * 2)  # the second call goes over the budget
    assert obs.splitlines() == ["42", "error: tool budget exhausted (0 left, calculator costs 1)"]
    assert done is True
    assert info["over_budget"] is True
    assert info["tool_calls"] == 3


def test_self_verify_env_model_decides_when_to_answer() -> None:
    env = self_verify_env(SAMPLE, cost=1.0, budget=1.0)
    env.reset()
    obs, done, _ = env.step("<verify><answer>41</answer></verify>")
    assert (obs, done) == ("incorrect", False)
    obs, done, info = env.step("<answer>42</answer>")
    assert done is True
    assert info["final_answer"] == "42"
    env.reset()
    env.step("<verify><answer>42</answer></verify>")
    obs, done, info = env.step("<verify><answer>42</answer></verify>")
    assert done is True
    assert info["over_budget"] is True


def test_text_game_quest_and_invalid_actions() -> None:
    game = TextGameEnvironment(
        Sample(
            index=0,
            group_index=0,
            prompt="",
            label={"item": "key", "item_room": "library", "room": "tower"},
        )
    )
    assert "bring the key to the tower" in game.reset()
    _, done, info = game.step("fly away")
    assert info["invalid_actions"] == 1
    assert not done
    assert "You see a key" in game.step("move north")[0]
    game.step("pick up key")
    game.step("complete quest")  # not in the tower yet: invalid
    game.step("move east")
    obs, done, info = game.step("Complete quest.")
    assert (obs, done, info["completed"], info["invalid_actions"]) == (
        "Quest complete!",
        True,
        True,
        2,
    )
    stubborn = TextGameEnvironment(None, max_invalid=2)
    stubborn.reset()
    stubborn.step("x")
    assert stubborn.step("y")[1] is True  # too many invalid actions end the game


def test_resolve_env_factory() -> None:
    assert resolve_env_factory("single_turn") is SingleTurnEnvironment
    env = resolve_env_factory("rollouts.envs.builtin.calculator_env")(SAMPLE)
    assert "calculator" in env.tools
    with pytest.raises(Exception, match="no attribute"):
        resolve_env_factory("rollouts.envs.builtin.nothing")
