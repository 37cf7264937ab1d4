"""The shop agent as people write it: the `openai` SDK, two tools it runs itself, several turns.

The task of configs/smollm2-agent-cpu.toml (questions about a shop whose prices and stock only
`lookup` knows, and whose products need `calculator`), written against the OpenAI chat API with
`tools`, importing nothing from `rollouts`. The catalogue comes with each question (the prompt
row's `catalogue` column, handed over as `metadata`); run against a server by hand with a
catalogue as JSON:

    python examples/openai_shop_agent.py http://127.0.0.1:8000/v1 \
        "What do 3 units of kettle cost?" '{"kettle": {"price": 22, "stock": 62}}'

Trained unchanged through the gateway by configs/smollm2-gateway-cpu.toml:

    rollout.generate_fn = "rollouts.gateway.agent_generate"
    [rollout.gateway]
    agent = "examples.openai_shop_agent.solve"

The tools are described as the environment describes them (`rollouts.envs.shop.shop_tool_specs`;
a test keeps the two equal), so the SFT traces the config starts from show the model the same
system message the gateway renders for this agent.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys
from collections.abc import Mapping
from typing import Any

from openai import AsyncOpenAI

MAX_TURNS = 4
MAX_TOKENS = 48
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "An item's price and stock.",
            "parameters": {"type": "object", "properties": {"item": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only whole numbers and + - *")


def run_tool(name: str, arguments: str, catalogue: Mapping[str, Any]) -> str:
    """A tool's result, or an error the model can read."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if name == "lookup":
        item = str(args.get("item", ""))
        facts = catalogue.get(item.strip().lower())
        if facts is None:
            return f"error: no item named {item!r}"
        return json.dumps({"item": item, "price": facts["price"], "stock": facts["stock"]})
    if name == "calculator":
        try:
            return str(_eval(ast.parse(str(args.get("expression", "")), mode="eval").body))
        except (SyntaxError, ValueError) as e:
            return f"error: {e}"
    return f"error: no tool named {name!r}"


async def solve(
    base_url: str, prompt: list[dict[str, Any]] | str, metadata: Mapping[str, Any]
) -> str:
    """Answer `prompt` with the model behind `base_url`; the final reply's text."""
    messages: list[Any] = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else [dict(m) for m in prompt]
    )
    catalogue = metadata.get("catalogue") or {}
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments, catalogue)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""  # no answer within MAX_TURNS


if __name__ == "__main__":
    print(asyncio.run(solve(sys.argv[1], sys.argv[2], {"catalogue": json.loads(sys.argv[3])})))
