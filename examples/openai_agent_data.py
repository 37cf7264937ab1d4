"""The data of the gateway demo (configs/demo-gateway-cpu.toml): 2-digit sums, SFT conversations
that call `examples/openai_agent.py`'s calculator exactly as the gateway shows it to the model.

The tools go into the system message (the tiny model's template does not render `tools`), a call
is written `<tool_call>{json}</tool_call>` (`rollouts.envs.tool_format`), the tool's answer comes
back as a tool message, and the model answers "Answer: N".
"""

from __future__ import annotations

from typing import Any

from examples.openai_agent import CALCULATOR
from rollouts.config import DataConfig
from rollouts.data.arithmetic import ANSWER_MARKER, Problem, prepare_demo_data
from rollouts.envs.tool_format import ToolSpec, call_text, tool_system_text


def gateway_conversation(p: Problem) -> dict[str, Any]:
    """One SFT conversation: the tools, the sum, the call, its result, the answer."""
    tools = tool_system_text([ToolSpec.from_openai(CALCULATOR)])
    return {
        "messages": [
            {"role": "system", "content": tools},
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": call_text("calculator", {"expression": p.question})},
            {"role": "tool", "content": p.answer},
            {"role": "assistant", "content": f"{ANSWER_MARKER} {p.answer}"},
        ]
    }


def prepare(data: DataConfig) -> None:
    """`data.prepare` hook of the gateway demo."""
    prepare_demo_data(data, gateway_conversation)
