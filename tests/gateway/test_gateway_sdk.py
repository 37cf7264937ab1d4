"""The gateway through the `openai` SDK, on the real built-in engine server: each episode is the
engine's tokens exactly; refused fields, edited history and concurrent sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
import trio

from rollouts.config.gateway import GatewayConfig
from rollouts.engine.launch import EngineProcess
from rollouts.gateway import AgentGenerate, open_gateway
from rollouts.inference.sglang import SGLangEngine
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status
from rollouts.wire.generation import SamplingParams
from tests.gateway.conftest import Recording

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def engine(server: EngineProcess) -> AsyncIterator[Recording]:
    client = SGLangEngine(server.url)
    try:
        yield Recording(client)
    finally:
        await client.aclose()


async def run_episode(
    engine: Any, tok: Any, agent: Callable[..., Any], prompt: str, rid: str, **sampling: Any
) -> Sample:
    """One sample's episode of `agent` through a gateway of its own."""
    async with open_gateway() as gateway:
        generate = AgentGenerate(gateway=gateway, agent=agent, config=GatewayConfig(max_calls=4))
        return await generate(make_sample(prompt), make_ctx(engine, tok, rid, **sampling))


def make_sample(prompt: str) -> Sample:
    return Sample(index=0, group_index=0, prompt=({"role": "user", "content": prompt},))


def make_ctx(engine: Any, tok: Any, rid: str, **sampling: Any) -> GenerateContext:
    params = SamplingParams(**{"max_new_tokens": 12, **sampling})
    return GenerateContext(
        engine=engine, tokenizer=tok, sampling=params, rid=rid, max_total_tokens=1000
    )


def assert_exact(sample: Sample, calls: list[tuple[tuple[int, ...], Any]]) -> None:
    """The sample is the engine's calls: each call's input a prefix, its output next (mask 1,
    its logprobs), and mask 1 nowhere else."""
    assert calls, "no engine call"
    assert sample.prompt_length == len(calls[0][0])
    trained: dict[int, float] = {}
    for ids, c in calls:
        assert sample.tokens[: len(ids)] == ids
        end = len(ids) + len(c.output_ids)
        assert sample.tokens[len(ids) : end] == c.output_ids
        trained.update(zip(range(len(ids), end), c.logprobs, strict=True))
    assert end == len(sample.tokens)
    assert [i for i, m in enumerate(sample.loss_mask) if m] == sorted(trained)
    start = sample.prompt_length
    for i, lp in enumerate(sample.rollout_logprobs):
        assert lp == trained.get(start + i, 0.0), (i, lp)


async def test_sdk_turns_are_the_engines_tokens_exactly(engine: Recording, tok) -> None:
    """Three calls with tools, tool_choice and logprobs: the sample is exactly what was sampled."""
    seen: list[Any] = []

    async def agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            messages = list(prompt)
            for i, choice in enumerate(["auto", "none", "auto"]):
                r = await client.chat.completions.create(
                    model=model, messages=messages, tools=TOOLS, tool_choice=choice, logprobs=True
                )
                seen.append(r)
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": f"go on {i}"})
        return "the answer"

    sample = await run_episode(engine, tok, agent, "12+34", "r0")
    assert sample.status is Status.COMPLETED
    calls = engine.of("r0-")
    assert len(calls) == 3
    assert_exact(sample, calls)
    for r, (_, c) in zip(seen, calls, strict=True):
        assert [t.logprob for t in r.choices[0].logprobs.content] == list(c.logprobs)
        assert r.usage.completion_tokens == len(c.output_ids)
        assert r.choices[0].finish_reason in ("stop", "length")
    assert sample.metadata["response_text"] == "the answer"
    assert sample.metadata["calls"] == 3
    roles = [m["role"] for m in sample.metadata["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    prompt = tok.decode(list(sample.prompt_tokens))
    assert '"name": "calculator"' in prompt, prompt  # the tools, in the system message
    assert tok.decode(list(sample.tokens)).count("go on 1") == 1


async def test_unrecordable_requests_are_refused_naming_the_field(engine: Recording, tok) -> None:
    """stream, n > 1, a forced tool call, another temperature: a 400 naming each; the episode
    goes on unharmed."""
    refused: dict[str, str] = {}

    async def agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            bad: dict[str, dict[str, Any]] = {
                "stream": {"stream": True},
                "n": {"n": 2},
                "tool_choice": {"tool_choice": "required", "tools": TOOLS},
                "temperature": {"temperature": 0.3},
            }
            for field, extra in bad.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=prompt, **extra)
                assert e.value.body["param"] == field, e.value.body
                refused[field] = e.value.message
            r = await client.chat.completions.create(model="m", messages=prompt)
            return r.choices[0].message.content or ""

    sample = await run_episode(engine, tok, agent, "1+2", "r1")
    assert sample.status is Status.COMPLETED
    assert sample.metadata["calls"] == 1
    assert_exact(sample, engine.of("r1-"))
    assert "stream=false" in refused["stream"]
    assert "n=1" in refused["n"]
    assert "constrained decoding" in refused["tool_choice"]
    assert "rollout.sampling.temperature" in refused["temperature"]


async def test_a_call_that_edits_history_is_refused(engine: Recording, tok) -> None:
    """An edited earlier turn is a 400 that says why; appending to the real history works."""
    errors: list[str] = []

    async def agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            r = await client.chat.completions.create(model="m", messages=prompt)
            reply = r.choices[0].message.model_dump(exclude_none=True)
            edited = [{"role": "user", "content": "something else"}, reply]
            for history in (edited, [prompt[0]], [*prompt, {**reply, "content": "changed"}]):
                with pytest.raises(openai.BadRequestError) as e:
                    more = [{"role": "user", "content": "and?"}]
                    await client.chat.completions.create(model="m", messages=history + more)
                errors.append(e.value.message)
            history = [*prompt, reply, {"role": "user", "content": "and?"}]
            await client.chat.completions.create(model="m", messages=history)
        return "done"

    sample = await run_episode(engine, tok, agent, "5+6", "r2")
    assert sample.metadata["calls"] == 2
    assert_exact(sample, engine.of("r2-"))
    assert "messages[0] (user) differs" in errors[0], errors[0]
    assert "only append" in errors[0]
    assert "messages[1] (assistant) differs" in errors[2], errors[2]


async def test_concurrent_sessions_do_not_mix(engine: Recording, tok) -> None:
    """Six agents at once (async and sync SDK clients): each sample holds only its own calls."""

    async def async_agent(base_url: str, prompt: Any, metadata: Any) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = list(prompt)
            for _ in range(2):
                r = await client.chat.completions.create(model="m", messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": prompt[0]["content"]}]
        return prompt[0]["content"]

    def sync_agent(base_url: str, prompt: Any, metadata: Any) -> str:
        with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = list(prompt)
            for _ in range(2):
                r = client.chat.completions.create(model="m", messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": prompt[0]["content"]}]
        return prompt[0]["content"]

    out: dict[int, Sample] = {}
    async with open_gateway() as gateway:

        async def one(i: int) -> None:
            agent = sync_agent if i % 2 else async_agent
            generate = AgentGenerate(gateway=gateway, agent=agent, config=GatewayConfig())
            ctx = make_ctx(engine, tok, f"c{i}", max_new_tokens=8)
            out[i] = await generate(make_sample(f"{i}{i}+{i}"), ctx)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        assert not gateway.sessions  # every session closed with its episode
    for i, sample in out.items():
        assert sample.metadata["response_text"] == f"{i}{i}+{i}"
        assert_exact(sample, engine.of(f"c{i}-"))
        text = tok.decode(list(sample.tokens))
        assert text.count(f"{i}{i}+{i}") == 2, text  # the prompt, then the follow-up
