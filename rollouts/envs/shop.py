"""A shop whose facts only its tools know: the real-model agent task (configs/smollm2-agent-cpu).

A question ("What do 7 units of lamp cost?") names an item of a catalogue the model has never
seen; the price (and the stock) come only from `lookup(item)`, and the product of two 2-digit
numbers is beyond a small model's head, so it comes from `calculator(expression)`. An episode is
therefore at least two tool calls over at least two turns, then "Answer: N". The catalogue
travels with each prompt (`sample.metadata["catalogue"]`: `{item: {"price": p, "stock": s}}`),
written by `rollouts.envs.shop_data`. The tools reach the model through its chat template
(`ToolEnvironment.tool_specs`, read by the agent loop: `envs/tool_format.with_tools`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rollouts.envs.builtin import ToolEnvironment, calculate
from rollouts.envs.tool_format import ToolSpec
from rollouts.envs.tools import Tool
from rollouts.types import Sample

CATALOGUE_KEY = "catalogue"
ANSWER_MARKER = "Answer:"
_ANSWER = re.compile(rf"{ANSWER_MARKER}\s*(-?\d+)")


def shop_tool_specs() -> tuple[ToolSpec, ...]:
    """The two tools as the model is told about them."""
    lookup = ToolSpec(
        name="lookup",
        description="An item's price and stock.",
        parameters={"type": "object", "properties": {"item": {"type": "string"}}},
    )
    calculator = ToolSpec(
        name="calculator",
        description="Evaluates arithmetic.",
        parameters={"type": "object", "properties": {"expression": {"type": "string"}}},
    )
    return (lookup, calculator)


def stated_answer(text: str) -> str:
    """The number after the last "Answer:" in `text`, or "" when there is none."""
    found = _ANSWER.findall(text)
    return found[-1] if found else ""


def _catalogue_of(sample: Sample) -> Mapping[str, Mapping[str, int]]:
    catalogue = sample.metadata.get(CATALOGUE_KEY)
    if not isinstance(catalogue, Mapping) or not catalogue:
        raise ValueError(
            f"sample {sample.index}: the shop environment needs metadata[{CATALOGUE_KEY!r}] "
            "(a non-empty {item: {price, stock}} column of the prompt file, as "
            "rollouts.envs.shop_data writes it)"
        )
    return catalogue


def shop_env(sample: Sample, budget: float = 4.0) -> ToolEnvironment:
    """`lookup(item)` and `calculator(expression)`, each of cost 1, over the sample's catalogue.

    The episode succeeds (`info["success"]`) when the final answer states the label.
    """
    catalogue = _catalogue_of(sample)

    def lookup(item: str = "", **_: Any) -> str:
        facts = catalogue.get(str(item).strip().lower())
        if facts is None:
            raise KeyError(f"no item named {item!r} in the catalogue")
        return json.dumps({"item": item, "price": facts["price"], "stock": facts["stock"]})

    tools = {
        "lookup": Tool(name="lookup", fn=lookup),
        "calculator": Tool(name="calculator", fn=calculate),
    }
    return ToolEnvironment(
        tools,
        budget,
        expected=None if sample.label is None else str(sample.label).strip(),
        tool_specs=shop_tool_specs(),
        answer_of=stated_answer,
    )
