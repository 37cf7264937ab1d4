"""Built-in environments: single-turn text, a calculator tool, self-verification.

`ToolEnvironment` is the shared shape of the tool environments: each step parses the model's
tool calls, runs them against a cost budget and answers with their outputs (role "tool"); a
message with no tool call is the final answer and ends the episode. Going over the budget ends
the episode too, so a tool loop is always bounded.

Per-step signals for `rollouts.rewards.trajectory`: `info["invalid_action"]` is true when a
step held an invalid call (unknown tool, bad arguments, a raising tool, over budget); with an
`expected` answer, the final step reports `info["success"]` (the answer matches it).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollouts.envs.tool_format import ToolSpec
from rollouts.envs.tools import Tool, parse_tool_calls, run_tool_call
from rollouts.types import Sample

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """The text inside the last <answer>...</answer>, or the whole text stripped."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()


class SingleTurnEnvironment:
    """One model turn and done: the plain RL setting expressed as an environment."""

    def __init__(self, sample: Sample | None = None) -> None:
        self.answer = ""

    def reset(self) -> str:
        return ""

    def step(self, action: str) -> tuple[str, bool, Mapping[str, Any]]:
        self.answer = extract_answer(action)
        return "", True, {"final_answer": self.answer}


class ToolEnvironment:
    """Tool calls with per-call costs against a budget; a turn with no call is the answer.

    `tool_specs` describe the tools to the model: the agent loop puts them before it through
    the chat template (`envs/tool_format.with_tools`); `()` leaves the prompt as it is.
    `answer_of` reads the answer out of the final message (compared with `expected`).
    """

    def __init__(
        self,
        tools: Mapping[str, Tool],
        budget: float,
        first_observation: str = "",
        expected: str | None = None,
        tool_specs: Sequence[ToolSpec] = (),
        answer_of: Callable[[str], str] = extract_answer,
    ):
        assert budget >= 0.0, f"{budget=} must be >= 0"
        assert tools, "a tool environment needs at least one tool"
        unknown = {t.name for t in tool_specs} - set(tools)
        assert not unknown, f"tool_specs name tools the environment lacks: {sorted(unknown)}"
        self.tools = dict(tools)
        self.tool_specs = tuple(tool_specs)
        self.answer_of = answer_of
        self.budget = budget
        self.first_observation = first_observation
        self.expected = expected
        self.spent = 0.0
        self.num_calls = 0
        self.num_invalid_calls = 0
        self.over_budget = False

    def reset(self) -> str:
        self.spent, self.num_calls, self.num_invalid_calls = 0.0, 0, 0
        self.over_budget = False
        return self.first_observation

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {
            "role": "tool",
            "tool_cost": self.spent,
            "tool_calls": self.num_calls,
            "invalid_tool_calls": self.num_invalid_calls,
            "over_budget": self.over_budget,
            "invalid_action": False,
            **extra,
        }

    def step(self, action: str) -> tuple[str, bool, Mapping[str, Any]]:
        calls = parse_tool_calls(action, self.tools)
        if not calls:
            answer = self.answer_of(action)
            success = {} if self.expected is None else {"success": answer == self.expected}
            return "", True, self._info(role="user", final_answer=answer, **success)
        outputs, invalid_before = [], self.num_invalid_calls
        for call in calls:
            result = run_tool_call(call, self.tools, self.budget - self.spent)
            self.spent += result.cost
            self.num_calls += 1
            self.num_invalid_calls += 0 if result.ok else 1
            self.over_budget = self.over_budget or result.over_budget
            outputs.append(result.output)
            if result.over_budget:
                break
        invalid = self.num_invalid_calls > invalid_before  # over budget counts as invalid
        return "\n".join(outputs), self.over_budget, self._info(invalid_action=invalid)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.FloorDiv: operator.floordiv,
}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses), no names."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval_node(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def calculator_env(sample: Sample | None = None, budget: float = 4.0) -> ToolEnvironment:
    """An environment with one `calculator(expression)` tool of cost 1."""
    return ToolEnvironment({"calculator": Tool(name="calculator", fn=calculate)}, budget)


def self_verify_env(sample: Sample, cost: float = 1.0, budget: float = 2.0) -> ToolEnvironment:
    """A `verify(answer)` tool that says whether a candidate matches the label, at a cost.

    The model decides when to verify and when to answer (a turn with no tool call).
    """
    expected = str(sample.label).strip()

    def verify(answer: str = "", **_: Any) -> str:
        return "correct" if str(answer).strip() == expected else "incorrect"

    tools = {"verify": Tool(name="verify", fn=verify, cost=cost)}
    return ToolEnvironment(tools, budget, expected=expected)
