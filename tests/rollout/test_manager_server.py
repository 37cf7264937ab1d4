"""AsyncRolloutManager and the agent loop against the real built-in engine server.

One server per module (started as a subprocess on a free port); each test gets its own client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollouts.engine.launch import EngineProcess
from rollouts.inference.sglang import SGLangEngine
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import Status
from tests.rollout import manager_cases as cases


@pytest.fixture(params=["batched", "per-sample"])
async def engine(server: EngineProcess, request) -> AsyncIterator[SGLangEngine]:
    """The SGLang client: a group as one batch request (the default), or one per sample."""
    client = SGLangEngine(server.url)
    client.batch_generate = request.param == "batched"
    try:
        yield client
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "case",
    [
        cases.groups_of_n_and_surplus_aborted,
        cases.filter_triggers_extra_sampling,
        cases.over_sampling_bound_stops,
        cases.raising_fns_are_reported,
        cases.partial_resume_and_buffer_state,
        cases.surplus_is_reused_or_reset,
    ],
    ids=lambda c: c.__name__,
)
async def test_manager_case(case, engine, tok) -> None:
    await case(engine, tok)


async def test_multi_turn_text_game_on_the_server(engine, tok) -> None:
    """Sampled tokens kept with mask 1 and logprobs; game observations in with mask 0."""
    config = cases.make_config(
        batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        max_turns=3,
        env="text_game",
        max_total_tokens=400,
        max_new_tokens=12,
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(cases.alternating_reward(lambda g: False))
    for s in batch.samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        response_mask = s.loss_mask[s.prompt_length :]
        assert not any(s.loss_mask[: s.prompt_length])
        trained = [lp for lp, m in zip(s.rollout_logprobs, response_mask, strict=True) if m]
        assert len(trained) == sum(s.loss_mask)
        assert all(lp < 0.0 for lp in trained)  # real engine logprobs on the model's tokens
        assert all(
            lp == 0.0 for lp, m in zip(s.rollout_logprobs, response_mask, strict=True) if not m
        )
        messages = s.metadata["messages"]
        assert messages[1]["content"].startswith("Quest:")
        assert s.metadata["turns"] >= 1
        untrained = tok.decode([t for t, m in zip(s.tokens, s.loss_mask, strict=True) if not m])
        for m in messages[2:]:
            if m["role"] != "assistant":  # every observation is in the tokens, untrained
                assert m["content"] in untrained
