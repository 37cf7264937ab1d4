"""examples/openai_shop_agent.py through the gateway, under SmolLM2's real template: an episode
the model writes as an SFT trace (lookup, calculator, answer) is that trace token for token, so
configs/smollm2-gateway-cpu.toml's SFT traces teach what the gateway shows the model."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from examples.openai_shop_agent import TOOLS, solve
from rollouts.config.gateway import GatewayConfig
from rollouts.data.arithmetic import final_answer_reward
from rollouts.data.sft import encode, render
from rollouts.envs.shop import shop_tool_specs
from rollouts.envs.shop_data import INSTRUCTIONS, write_shop_datasets
from rollouts.envs.tool_format import ToolSpec
from rollouts.gateway import AgentGenerate, open_gateway
from rollouts.types import Sample, Status
from tests.gateway.test_gateway_scripted import VersionedEngine
from tests.gateway.test_gateway_sdk import assert_exact, make_ctx


def test_the_agent_describes_the_tools_as_the_environment_does() -> None:
    assert tuple(ToolSpec.from_openai(t) for t in TOOLS) == shop_tool_specs()


async def test_an_episode_is_the_sft_trace_token_for_token(tmp_path: Path, smollm2_dir) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    paths = write_shop_datasets(tmp_path)
    rows = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    trace = rows[0]["messages"]
    # the prompt as data rows hold it: the instructions (no tools) and the trace's question
    prompt = ({"role": "system", "content": INSTRUCTIONS}, trace[1])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = [[*encode(tok, m["content"]), end] for m in trace if m["role"] == "assistant"]
    engine = VersionedEngine(replies, end)
    item = json.loads(trace[3]["content"])["item"]
    catalogue = {item: {k: v for k, v in json.loads(trace[3]["content"]).items() if k != "item"}}
    sample = Sample(
        index=0,
        group_index=0,
        prompt=prompt,
        label=trace[-1]["content"].split()[-1],
        metadata={"catalogue": catalogue},
    )
    async with open_gateway() as gateway:
        generate = AgentGenerate(gateway=gateway, agent=solve, config=GatewayConfig(max_calls=4))
        out = await generate(sample, make_ctx(engine, tok, "shop", max_new_tokens=48))
    assert out.status is Status.COMPLETED, out.metadata
    assert out.metadata["tool_calls"] == 2 and out.metadata["calls"] == 3
    assert_exact(out, engine.calls)
    # what the model saw and wrote is the SFT trace, rendered by the real template (but for the
    # newline the template puts after the last turn, which the model, stopping at <|im_end|>,
    # never writes)
    assert tok.decode(list(out.tokens)) + "\n" == render(tok, trace, False)
    assert final_answer_reward(out) == 1.0
