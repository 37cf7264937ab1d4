"""AsyncRolloutManager against the in-process fake engine (fast; the logic, not the wire)."""

from __future__ import annotations

import pytest

from rollouts.config import LengthShapingConfig, RewardConfig
from rollouts.loop.batch import rollout_metrics
from rollouts.rewards.computers import rank_normalize
from rollouts.rewards.shaping import scored_reward
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.sample_runs import TIMING_KEY
from tests.rollout import manager_cases as cases
from tests.rollout.fakes import RandomEngine


@pytest.fixture
def engine(tok) -> RandomEngine:
    return RandomEngine(eos_id=tok.eos_token_id, eos_prob=0.05)


@pytest.mark.parametrize(
    "case",
    [
        cases.groups_of_n_and_surplus_aborted,
        cases.filter_triggers_extra_sampling,
        cases.over_sampling_bound_stops,
        cases.raising_fns_are_reported,
        cases.partial_resume_and_buffer_state,
        cases.sync_generate_fn_by_dotted_path,
        cases.surplus_is_reused_or_reset,
    ],
    ids=lambda c: c.__name__,
)
async def test_manager_case(case, engine, tok) -> None:
    await case(engine, tok)


async def test_slow_reward_times_out_as_failed(engine, tok, autojump_clock) -> None:
    await cases.slow_reward_times_out_as_failed(engine, tok)


async def test_a_batch_leaves_with_its_final_rewards(engine, tok) -> None:
    """[reward] shaping is applied to the kept groups (after the filters saw the scored
    rewards); the scored reward stays in metadata["raw_reward"] (`scored_reward`)."""
    config = cases.make_config(
        batch_size=2, n_samples_per_prompt=3, filters=["check_reward_nonzero_std"]
    )
    shaping = RewardConfig(
        transform="relative", length=LengthShapingConfig(efficiency_coef=0.5, max_length=8)
    )
    manager = AsyncRolloutManager(
        cases.make_buffer(), config, engine, tokenizer=tok, reward_shaping=shaping
    )
    batch = await manager.generate_batch(cases.alternating_reward(lambda g: g % 2 == 0))
    assert [g[0].group_index for g in batch.groups] == [1, 3]  # constant groups filtered out
    for group in batch.groups:
        scored = [scored_reward(s) for s in group]
        assert sorted(scored) == [0.0, 1.0, 1.0]  # as the reward function gave them (any order)
        ranks = rank_normalize(scored)  # 0 -> 0, the tied 1s share rank 1.5 / 2 = .75
        assert sorted(ranks) == [0.0, 0.75, 0.75]
        bonus = [
            0.5 * max(0.0, 1.0 - s.response_length / 8) if r > 0 else 0.0
            for s, r in zip(group, ranks, strict=True)
        ]
        expected = [r + b for r, b in zip(ranks, bonus, strict=True)]
        assert [s.reward for s in group] == pytest.approx(expected)
    plain = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await plain.generate_batch(cases.alternating_reward(lambda g: False))
    assert all("raw_reward" not in s.metadata for g in batch.groups for s in g)  # as scored


async def test_the_groups_a_filter_dropped_count_in_the_signal_and_samples_are_timed(
    engine, tok
) -> None:
    """Groups 0 and 2 (all rewards 1.0) are dropped by check_reward_nonzero_std, 1 and 3
    (rewards 1, 0) kept: half the groups the batch saw carried no signal, though none of the
    kept ones shows it. Every kept sample says how long it waited, generated and was scored."""
    config = cases.make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        filters=["check_reward_nonzero_std"],
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(cases.alternating_reward(lambda g: g % 2 == 0))
    assert [g[0].group_index for g in batch.groups] == [1, 3]
    assert batch.metadata["group_signal"] == {
        "groups": 4.0,
        "all_equal": 2.0,
        "all_correct": 2.0,
        "passed": 4.0,
        "spread_sum": 2.0,
    }
    metrics = rollout_metrics(batch.groups, batch.metadata)
    assert metrics["groups/all_equal_frac"] == 0.5 and metrics["groups/pass_at_k"] == 1.0
    assert metrics["reward/spread_mean"] == 0.5
    assert rollout_metrics(batch.groups, {})["groups/all_equal_frac"] == 0.0  # kept alone
    for s in batch.samples:
        timing = s.metadata[TIMING_KEY]
        assert set(timing) == {"queue_s", "generate_s", "reward_s"}, timing
        assert timing["generate_s"] > 0.0 and min(timing.values()) >= 0.0, timing
