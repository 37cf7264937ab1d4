"""examples/openai_agent.py, unchanged, against vLLM's own OpenAI server (no training): the
gateway speaks the wire real servers speak, what an agent sends back after a gateway answer
(assistant tool calls, tool results) is what vLLM takes too, and the prompt vLLM builds for a
conversation with tools (its `--chat-template`, envs/templates/smollm2_tools.jinja) is token for
token the one the agent loop and the gateway build (`render_with_tools`)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from examples.openai_agent import CALCULATOR, solve
from rollouts.data.sft import encode
from rollouts.envs.shop import shop_tool_specs
from rollouts.envs.tool_format import ToolSpec, render_with_tools
from tests.real_vllm.conftest import VLLMServer

pytestmark = pytest.mark.smollm2  # on the "smollm2" server (conftest.py)


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


def _call(name: str, arguments: dict) -> dict:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{name}", "type": "function", "function": fn}


MULTIPLY = _call("calculator", {"expression": "7 * 12"})
SYSTEM = {"role": "system", "content": "Answer questions about a shop with its tools."}
EPISODE = [
    {"role": "user", "content": "What do 7 units of lamp cost?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("lookup", {"item": "lamp"})]},
    {"role": "tool", "tool_call_id": "call_lookup", "content": '{"price": 12, "stock": 40}'},
    {"role": "assistant", "content": "", "tool_calls": [MULTIPLY]},
    {"role": "tool", "tool_call_id": "call_calculator", "content": "84"},
]


def test_vllm_builds_the_prompt_the_agent_loop_builds(
    vllm: dict[str, VLLMServer], smollm2_dir: Path
) -> None:
    """vLLM's /tokenize (messages + tools, its chat template) = our rendering, token for token."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    calculator = (ToolSpec.from_openai(CALCULATOR),)
    cases = [
        ([SYSTEM, *EPISODE], shop_tool_specs()),
        (EPISODE, shop_tool_specs()),  # no system message: the tools make one
        ([SYSTEM, *EPISODE[:1]], calculator),
        (EPISODE[:1], ()),  # no tools: SmolLM2's own default system message
    ]
    for messages, tools in cases:
        body = {"messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = [t.to_openai() for t in tools]
        r = httpx.post(f"{vllm['smollm2'].url}/tokenize", json=body, timeout=60.0)
        assert r.status_code == 200, r.text
        ours = encode(tokenizer, render_with_tools(tokenizer, messages, tools, True))
        assert r.json()["tokens"] == ours, (len(messages), [t.name for t in tools])
