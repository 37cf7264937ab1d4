"""AsyncRolloutManager against the in-process fake engine (fast; the logic, not the wire)."""

from __future__ import annotations

import pytest

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
