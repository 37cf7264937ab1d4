"""The gateway's rules on scripted engines: tool calls over the wire (the example agent), the
weight version of each call, a dropped sample, the call bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import openai
import pytest
import trio

from examples.openai_agent import solve
from rollouts.config.gateway import GatewayConfig
from rollouts.data.sft import encode
from rollouts.envs.tool_format import call_text
from rollouts.gateway import AgentGenerate, open_gateway
from rollouts.types import Status
from rollouts.wire.generation import Completion, FinishReason, SamplingParams
from tests.gateway.test_gateway_sdk import assert_exact, make_ctx, make_sample, run_episode
from tests.rollout.fakes import ScriptedEngine


class VersionedEngine(ScriptedEngine):
    """Scripted replies; the weights move on after each call (a sync in "keep"/"wait" mode)."""

    def __init__(self, replies: Sequence[Sequence[int]], eos_id: int) -> None:
        super().__init__(replies, eos_id)
        self.calls: list[tuple[tuple[int, ...], Completion]] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        completion = await super().generate(input_ids, sampling, rid)
        self.calls.append((tuple(input_ids), completion))
        self.version = str(int(self.version) + 1)
        return completion


class AbortingEngine:
    """Fault injection: a call runs until `abort` names its request id, then ends ABORT with the
    tokens it had made (what a surplus abort or a sync in abort mode does)."""

    url = "fake://aborting"

    def __init__(self) -> None:
        self.started = trio.Event()
        self.aborted = trio.Event()
        self.requests = 0

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        self.requests += 1
        self.started.set()
        await self.aborted.wait()
        return Completion(
            output_ids=(65, 66),
            logprobs=(-1.0, -1.0),
            finish_reason=FinishReason.ABORT,
            weight_version="0",
            prompt_tokens=len(input_ids),
            completion_tokens=2,
        )

    async def abort(self, rid_prefix: str) -> None:
        self.aborted.set()


def reply(tok: Any, text: str) -> list[int]:
    return [*encode(tok, text), tok.eos_token_id]


async def test_the_example_agent_calls_its_tool_through_the_gateway(tok) -> None:
    """examples/openai_agent.py: a tool call comes back as OpenAI tool_calls, the tool's answer
    goes in as a tool message, the final answer is the sample's response_text; the sampled
    tokens are trained exactly, each call's weight version recorded."""
    call = call_text("calculator", {"expression": "12+34"})
    engine = VersionedEngine([reply(tok, call), reply(tok, "Answer: 46")], tok.eos_token_id)
    sample = await run_episode(engine, tok, solve, "12+34", "t0", max_new_tokens=100)
    assert sample.status is Status.COMPLETED
    assert sample.metadata["response_text"] == "Answer: 46"
    assert sample.metadata["tool_calls"] == 1
    # the agent loop's fields, so agent/* metrics count gateway episodes too
    assert sample.metadata["episode_end"] == "answer"
    assert sample.metadata["env_info"] == {"tool_calls": 1}
    assert sample.metadata["episode_tokens"] == len(sample.tokens)
    assert sample.metadata["sampled_tokens"] == sum(sample.loss_mask)
    messages = sample.metadata["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    fn = messages[1]["tool_calls"][0]["function"]
    assert (fn["name"], fn["arguments"]) == ("calculator", '{"expression": "12+34"}')
    assert messages[2]["content"] == "46"  # the agent ran its calculator
    assert_exact(sample, engine.calls)
    assert sample.weight_versions == ("0", "1")
    text = tok.decode(list(sample.tokens))
    assert f"assistant\n{call}<|im_end|>\n<|im_start|>tool\n46<|im_end|>" in text, text


async def test_a_dropped_sample_gets_a_clear_error_and_restarts(tok) -> None:
    """An engine abort of a call (surplus sample, sync in abort mode): that call and every later
    one get a 410 saying the sample was dropped; the sample goes back ABORTED with no tokens."""
    engine = AbortingEngine()
    errors: list[openai.APIStatusError] = []

    async def agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            for _ in range(2):
                try:
                    await client.chat.completions.create(model="m", messages=prompt)
                except openai.APIStatusError as e:
                    errors.append(e)
        return "an answer it made up"

    async with trio.open_nursery() as nursery:

        async def abort_when_started() -> None:
            await engine.started.wait()
            await engine.abort("d0-")

        nursery.start_soon(abort_when_started)
        sample = await run_episode(engine, tok, agent, "1+1", "d0")
    assert sample.status is Status.ABORTED
    assert (sample.tokens, sample.weight_versions) == ((), ())
    assert [e.status_code for e in errors] == [410, 410]
    assert all("sample dropped" in e.message for e in errors), errors[0].message
    assert engine.requests == 1  # the later call never reached the engine


async def test_max_calls_ends_the_episode_truncated(tok) -> None:
    """One call past rollout.gateway.max_calls is refused; the sample is TRUNCATED, scored on
    what the agent returns."""
    engine = VersionedEngine([reply(tok, "hm")] * 4, tok.eos_token_id)
    refusals: list[str] = []

    async def agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = list(prompt)
            while True:
                try:
                    r = await client.chat.completions.create(model="m", messages=messages)
                except openai.BadRequestError as e:
                    refusals.append(e.message)
                    return "gave up"
                messages += [r.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": "more"}]

    sample = await run_episode(engine, tok, agent, "2+2", "m0")
    assert sample.status is Status.TRUNCATED
    assert sample.metadata["calls"] == 4
    assert sample.metadata["episode_end"] == "max_turns"
    assert sample.metadata["response_text"] == "gave up"
    assert "rollout.gateway.max_calls" in refusals[0]
    assert_exact(sample, engine.calls)


@pytest.mark.parametrize("returned", [None, 3])
async def test_an_agent_that_returns_no_answer_fails_the_sample(tok, returned) -> None:
    engine = VersionedEngine([reply(tok, "x")], tok.eos_token_id)

    async def agent(base_url: str, prompt: Any, metadata: Any) -> Any:
        return returned

    async with open_gateway() as gateway:
        generate = AgentGenerate(gateway=gateway, agent=agent, config=GatewayConfig())
        with pytest.raises(RuntimeError, match="the agent returned"):
            await generate(make_sample("2+2"), make_ctx(engine, tok, "n0"))
