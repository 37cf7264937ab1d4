"""Trajectory rewards from step signals: a played text game pinned to hand-computed values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rollouts.algorithms.advantages import compute_advantages
from rollouts.config import AlgorithmConfig
from rollouts.data.sft import encode
from rollouts.envs import TextGameEnvironment
from rollouts.rewards.trajectory import (
    TrajectoryRewardSpec,
    default_trajectory_reward,
    group_turn_token_rewards,
    trajectory_reward,
    turn_rewards,
    turn_spans,
    turn_token_rewards,
)
from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.protocol import GenerateContext
from rollouts.types import Sample, Status
from rollouts.wire.generation import SamplingParams
from tests.rollout.fakes import ScriptedEngine

# the key is in the library (north), the quest room is the tower (library -> east)
LABEL = {"item": "key", "item_room": "library", "room": "tower"}
ACTIONS = ["fly away", "move north", "pick up key", "move east", "complete quest"]
SPEC = TrajectoryRewardSpec(
    step_weight=1.0, success_bonus=2.0, invalid_penalty=0.25, efficiency_bonus=1.0, max_turns=10
)
# per step: invalid -0.25; move 0; pick up +0.5; move 0; complete +1.0 + success 2.0 + eff 0.5
EXPECTED_STEPS = [-0.25, 0.0, 0.5, 0.0, 3.5]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def play(tok, actions: list[str], max_turns: int = 10) -> Sample:
    replies = [[*encode(tok, a), tok.eos_token_id] for a in actions]
    engine = ScriptedEngine(replies, tok.eos_token_id)
    ctx = GenerateContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=64),
        rid="r",
        max_total_tokens=2048,
        max_turns=max_turns,
        env_factory=TextGameEnvironment,
    )
    return await generate_multi_turn(
        Sample(index=0, group_index=0, prompt="play", label=LABEL), ctx
    )


async def test_text_game_reports_step_signals(tok) -> None:
    out = await play(tok, ACTIONS)
    infos = out.metadata["env_infos"]
    assert [i["step_reward"] for i in infos] == [0.0, 0.0, 0.5, 0.0, 1.0]
    assert [i["invalid_action"] for i in infos] == [True, False, False, False, False]
    assert [i["success"] for i in infos] == [False, False, False, False, True]
    assert out.metadata["turns"] == 5
    assert out.status is Status.COMPLETED


async def test_trajectory_reward_pinned(tok) -> None:
    out = await play(tok, ACTIONS)
    steps = turn_rewards(out.metadata["env_infos"], out.metadata["turns"], SPEC)
    assert steps == pytest.approx(EXPECTED_STEPS)
    assert trajectory_reward(SPEC)(out) == pytest.approx(3.75)
    # defaults: step 1.0, success 1.0, invalid 0.1, no efficiency bonus: -0.1 + 0.5 + 1 + 1
    assert default_trajectory_reward(out) == pytest.approx(2.4)
    # failing episode: three invalid actions end the game, no success, no efficiency bonus
    lost = await play(tok, ["dance", "sing", "jump"])
    assert lost.metadata["stop_reason"] == "env_done"
    assert trajectory_reward(SPEC)(lost) == pytest.approx(-0.75)
    giving_up = TrajectoryRewardSpec(
        efficiency_bonus=1.0, max_turns=4, efficiency_needs_success=False
    )
    # 3 turns of 4: 1 - 3/4 = 0.25 on top of 3 x -0.1
    assert trajectory_reward(giving_up)(lost) == pytest.approx(-0.05)


async def test_turn_token_rewards_on_last_token_of_each_turn(tok) -> None:
    out = await play(tok, ACTIONS)
    spans = turn_spans(out.loss_mask)
    assert len(spans) == 5
    for (start, end), action in zip(spans, ACTIONS, strict=True):
        assert tok.decode(list(out.tokens[start:end])) == action + tok.eos_token
    rewards_T = turn_token_rewards(out, SPEC)
    assert rewards_T.shape == (len(out.tokens),)
    expected_T = torch.zeros(len(out.tokens))
    for (_, end), r in zip(spans, EXPECTED_STEPS, strict=True):
        expected_T[end - 1] = r
    assert torch.equal(rewards_T, expected_T)
    assert float(rewards_T.sum()) == pytest.approx(trajectory_reward(SPEC)(out))


async def test_token_rewards_feed_reinforce(tok) -> None:
    """REINFORCE (gamma = 1): each trained token's advantage is the reward still to come."""
    out = await play(tok, ACTIONS)
    groups = [[out]]
    adv = compute_advantages(
        groups,
        AlgorithmConfig(advantage="reinforce", gamma=1.0),
        token_rewards=group_turn_token_rewards(groups, SPEC),
    )[0][0]
    for k, (start, end) in enumerate(turn_spans(out.loss_mask)):
        to_go = sum(EXPECTED_STEPS[k:])
        assert adv[start:end].tolist() == pytest.approx([to_go] * (end - start))
    assert not adv[torch.tensor(out.loss_mask) == 0].any()


def test_turn_spans_and_errors() -> None:
    assert turn_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert turn_spans([0, 0]) == []
    bad = Sample(index=3, group_index=0, prompt="p", metadata={"env_infos": [{"step_reward": "x"}]})
    with pytest.raises(ValueError, match="step_reward"):
        trajectory_reward(SPEC)(bad)
    with pytest.raises(ValueError, match="env_infos"):
        default_trajectory_reward(Sample(index=0, group_index=0, prompt="p"))
    two_steps = Sample(
        index=0,
        group_index=0,
        prompt="p",
        tokens=(1, 2, 3),
        loss_mask=(0, 1, 1),
        response_length=2,
        metadata={"env_infos": [{}, {}], "turns": 2},
    )
    with pytest.raises(ValueError, match="2 environment steps but 1 trained"):
        turn_token_rewards(two_steps, SPEC)
