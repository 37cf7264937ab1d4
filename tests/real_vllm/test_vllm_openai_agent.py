"""examples/openai_agent.py, unchanged, against vLLM's own OpenAI server (no training): the
gateway speaks the wire real servers speak, and what an agent sends back after a gateway answer
(assistant tool calls, tool results) is what vLLM takes too."""

from __future__ import annotations

import json

import openai

from examples.openai_agent import CALCULATOR, solve
from tests.real_vllm.conftest import VLLMServer


async def test_the_example_agent_runs_on_vllms_own_server(vllm: dict[str, VLLMServer]) -> None:
    answer = await solve(f"{vllm['smollm2'].url}/v1", "What is 23+45? Use the calculator.", {})
    assert isinstance(answer, str)


async def test_vllm_takes_a_conversation_with_a_tool_call(vllm: dict[str, VLLMServer]) -> None:
    """A history as the SDK dumps a gateway answer with a tool call, then the tool's result."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "23+45"})},
    }
    messages = [
        {"role": "user", "content": "What is 23+45?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "68"},
    ]
    base_url = f"{vllm['smollm2'].url}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        r = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], max_tokens=16, logprobs=True
        )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
