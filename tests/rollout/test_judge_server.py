"""An LLM judge as the reward, against a real built-in engine: the question it is asked, the
score read from its answer, an answer with no score failing only its sample (reward/unparsed,
counted, never a 0), and a judge with no engine left losing the batch."""

from __future__ import annotations

import pytest

from rollouts.config import EnginesConfig
from rollouts.config.served import JudgeConfig
from rollouts.inference.factory import make_pool
from rollouts.inference.http import EngineUnavailable
from rollouts.rewards.protocol import RewardUnparsed
from rollouts.rollout.judge import Judge, parse_score, question_of
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import Sample, Status
from rollouts.wire.ports import free_port
from tests.rollout import manager_cases as cases

CONFIG = JudgeConfig(path="/judge")


@pytest.mark.parametrize(
    ("answer", "score"),
    [("Score: 7", 0.7), ("score: 3\nScore: 10", 1.0), ("I think... Score:0.5 overall", 0.05)],
)
def test_the_first_score_is_read_and_scaled(answer: str, score: float) -> None:
    assert parse_score(answer, CONFIG) == pytest.approx(score)


@pytest.mark.parametrize(
    ("answer", "why"),
    [("Great answer!", "has no score"), ("Score: 11", r"outside \[0, 10\]"), ("Score: -1", "out")],
)
def test_an_answer_without_a_score_in_range_is_unparsed(answer: str, why: str) -> None:
    with pytest.raises(RewardUnparsed, match=why):
        parse_score(answer, CONFIG)


def test_the_question_shows_the_prompt_the_response_and_the_reference(tok) -> None:
    sample = Sample(
        index=0,
        group_index=0,
        prompt=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2"}),
        label="4",
        metadata={"response_text": "four"},
    )
    assert question_of(sample) == "2+2"
    config = JudgeConfig(path="/judge", template="Q={question} R={response} A={reference} {x}")
    judge = Judge(engines=None, tokenizer=tok, config=config)  # type: ignore[arg-type]
    text = tok.decode(judge.question(sample))
    assert "Q=2+2 R=four A=4 {x}" in text and text.startswith("<|im_start|>user")


async def test_a_judge_that_gives_no_score_fails_the_samples_by_name(engine, tok) -> None:
    """The tiny model answers noise: every sample FAILED as reward/unparsed, none scored 0."""
    judge = Judge(engines=engine, tokenizer=tok, config=JudgeConfig(path="/j", max_new_tokens=6))
    config = cases.make_config(
        batch_size=1, n_samples_per_prompt=2, over_sampling_factor=1.0, max_over_sampling_rounds=1
    )
    manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(judge)
    assert batch.metadata["failures"] == {"reward/unparsed": 2}, batch.metadata
    assert all("the judge's answer has no score" in e for e in batch.metadata["errors"])
    assert all(s.status is Status.FAILED and s.reward is None for s in batch.failed)


async def test_a_judge_with_no_engine_left_loses_the_batch(engine, tok) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = make_pool(EnginesConfig(wait_for_up_s=0.5, max_retries=0), [gone])
    try:
        judge = Judge(engines=pool, tokenizer=tok, config=CONFIG)
        config = cases.make_config(batch_size=1, n_samples_per_prompt=2, over_sampling_factor=1.0)
        manager = AsyncRolloutManager(cases.make_buffer(), config, engine, tokenizer=tok)
        with pytest.raises(EngineUnavailable, match="no judge engine is left"):
            await manager.generate_batch(judge)
    finally:
        await pool.aclose()
