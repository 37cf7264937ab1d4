"""Step-reward games and a model-played user on the real server.

One built-in engine server per module; a thin wrapper around the client records the inputs of
its generate requests (it delegates everything to the real client).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import trio

from rollouts.engine.launch import EngineProcess
from rollouts.envs import ConversationEnvironment, ModelUser, TextGameEnvironment
from rollouts.inference.sglang import SGLangEngine
from rollouts.rewards.trajectory import TrajectoryRewardSpec, trajectory_reward
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status
from rollouts.wire.generation import Completion, SamplingParams


class RecordingEngine:
    """The real client, with the inputs of its generate requests recorded."""

    def __init__(self, inner: SGLangEngine) -> None:
        self.inner = inner
        self.url = inner.url
        self.inputs: list[tuple[int, ...]] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        self.inputs.append(tuple(input_ids))
        return await self.inner.generate(input_ids, sampling, rid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def engine(server: EngineProcess) -> AsyncIterator[RecordingEngine]:
    client = SGLangEngine(server.url)
    try:
        yield RecordingEngine(client)
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


async def test_text_games_on_the_server(engine, tok) -> None:
    samples: list[Sample] = []

    async def play(i: int) -> None:
        sample = Sample(index=i, group_index=i, prompt=f"q{i}:")
        ctx = context(engine, tok, sample, TextGameEnvironment, max_turns=2)
        samples.append(await generate_multi_turn(sample, ctx))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(play, i)
    assert sorted(s.index for s in samples) == [0, 1, 2]
    assert [s.metadata["turns"] for s in samples] == [2, 2, 2]
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
