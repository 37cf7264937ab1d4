"""An agent as people write them: the `openai` SDK, a calculator tool it runs itself, several turns.

It imports nothing from `rollouts`: give it any OpenAI-compatible base_url (vLLM's own server,
or a training run's gateway, which hands each sample its own) and it solves the problem, calling
the calculator until the model answers without a tool call. Trained through the gateway with

    rollout.generate_fn = "rollouts.gateway.agent_generate"
    [rollout.gateway]
    agent = "examples.openai_agent.solve"

(configs/demo-gateway-cpu.toml). Run against a server by hand:

    python examples/openai_agent.py http://127.0.0.1:8000/v1 "What is 23+45?"

With vLLM serving SmolLM2, whose own template drops `tools`, give it the packaged template that
shows the tools as the training loop does, and the parser that reads the calls back:

    bash scripts/serve_vllm.sh MODEL_DIR 8000 --enable-auto-tool-choice \
      --tool-call-parser hermes --chat-template rollouts/envs/templates/smollm2_tools.jinja
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
MAX_TOKENS = 256  # a reply's bound (a server's own default can be its whole context; a training
# run's gateway gives each call the smaller of this and the run's rollout.sampling.max_new_tokens)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * /")


def calculator(expression: str) -> str:
    """The tool: the value of an arithmetic expression, or an error the model can read."""
    try:
        value = _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


def _run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: no tool named {name!r}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    return calculator(str(args.get("expression", "")))


async def solve(
    base_url: str, prompt: list[dict[str, Any]] | str, metadata: Mapping[str, Any]
) -> str:
    """Solve `prompt` with the model behind `base_url`; the final answer's text."""
    messages: list[Any] = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else [dict(m) for m in prompt]
    )
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=[CALCULATOR], max_tokens=MAX_TOKENS
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                result = _run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""  # no answer within MAX_TURNS


if __name__ == "__main__":
    print(asyncio.run(solve(sys.argv[1], sys.argv[2], {})))
