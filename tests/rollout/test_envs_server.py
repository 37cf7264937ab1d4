"""Step-reward games, a model-played user and the parallel-count runner on the real server.

One built-in engine server per module; a thin counting wrapper around the client records how
many generate requests are in flight at once (it delegates everything to the real client).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from rollouts.envs import ConversationEnvironment, ModelUser, TextGameEnvironment
from rollouts.inference.launch import EngineProcess
from rollouts.inference.protocol import Completion, SamplingParams
from rollouts.inference.sglang import SGLangEngine
from rollouts.rewards.trajectory import TrajectoryRewardSpec, trajectory_reward
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.parallel import maintain_parallel_count
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status


class CountingEngine:
    """The real client, with the number of generate requests in flight recorded."""

    def __init__(self, inner: SGLangEngine) -> None:
        self.inner = inner
        self.url = inner.url
        self.in_flight = 0
        self.max_in_flight = 0
        self.inputs: list[tuple[int, ...]] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.inputs.append(tuple(input_ids))
        try:
            return await self.inner.generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def engine(server: EngineProcess) -> AsyncIterator[CountingEngine]:
    client = SGLangEngine(server.url)
    try:
        yield CountingEngine(client)
    finally:
        await client.aclose()


def context(engine: Any, tok: Any, sample: Sample, env_factory: Any, max_turns: int):
    return GenerateContext(
        engine=engine,
        tokenizer=tok,
        # every token id stops: each assistant turn is one sampled token that ends with STOP,
        # so the number of turns is known (the tiny model rarely samples its EOS)
        sampling=SamplingParams(max_new_tokens=6, stop_token_ids=tuple(range(len(tok)))),
        rid=f"s{sample.index}",
        max_total_tokens=600,
        max_turns=max_turns,
        env_factory=env_factory,
    )


async def test_parallel_count_with_text_games(engine, tok) -> None:
    counter = itertools.count()
    in_flight, at_start = 0, []

    def make_sample() -> Sample:
        i = next(counter)
        return Sample(index=i, group_index=i, prompt=f"q{i}:")

    async def generate(sample: Sample) -> Sample:
        nonlocal in_flight
        in_flight += 1
        at_start.append(in_flight)
        try:
            ctx = context(engine, tok, sample, TextGameEnvironment, max_turns=2)
            return await generate_multi_turn(sample, ctx)
        finally:
            in_flight -= 1

    samples, stats = await maintain_parallel_count(make_sample, generate, num_parallel=3, total=7)
    assert len(samples) == 7
    assert sorted(s.index for s in samples) == list(range(7))
    assert at_start == [1, 2, 3] + [3] * 4  # refilled on every finish, never more than 3
    assert engine.max_in_flight == 3  # the server never saw more than 3 requests at once
    assert (stats.num_started, stats.num_failed, stats.max_in_flight) == (7, 0, 3)
    assert stats.response_length_max == max(s.response_length for s in samples)
    assert sum(stats.response_length_hist["counts"]) == 7
    assert stats.turns_mean == 2.0
    assert stats.statuses == {"completed": 7}
    # the tiny model's moves are gibberish: every stepped turn is an invalid action
    spec = TrajectoryRewardSpec(invalid_penalty=0.5)
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        infos = s.metadata["env_infos"]
        expected = sum(-0.5 if i["invalid_action"] else i["step_reward"] for i in infos)
        assert trajectory_reward(spec)(s) == pytest.approx(expected)


async def test_model_played_user_on_the_server(engine, tok) -> None:
    persona = "You want a cake recipe."
    user = ModelUser(
        engine=engine,
        tokenizer=tok,
        persona=persona,
        sampling=SamplingParams(max_new_tokens=5),
        end_marker="",  # the user never ends: the dialogue runs to max_turns
    )

    def factory(sample: Sample) -> ConversationEnvironment:
        # the loop steps the env after every turn, the last too: max_user_turns = max_turns - 1
        # ends the dialogue there instead of generating a user reply nobody reads
        return ConversationEnvironment(user, sample, max_user_turns=2)

    sample = Sample(index=0, group_index=0, prompt="Hello!")
    out = await generate_multi_turn(sample, context(engine, tok, sample, factory, max_turns=3))
    assert out.status is Status.COMPLETED
    assert out.metadata["stop_reason"] == "env_done"
    assert out.metadata["env_info"]["ended_by"] == "max_user_turns"
    messages = out.metadata["messages"]
    turns = out.metadata["turns"]
    assert turns == 3
    # the model played both sides: assistant turns and the user's replies in between
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "user"] * (turns - 1) + [
        "assistant"
    ]
    assert len(engine.inputs) == turns + (turns - 1)
    user_requests = [tok.decode(list(ids)) for ids in engine.inputs if persona in tok.decode(ids)]
    assert len(user_requests) == turns - 1
    assert all(r.startswith(f"<|im_start|>system\n{persona}") for r in user_requests)
    untrained = tok.decode([t for t, m in zip(out.tokens, out.loss_mask, strict=True) if not m])
    for m in messages[2::2]:  # the model-written user turns are in the tokens, untrained
        assert m["content"] in untrained
