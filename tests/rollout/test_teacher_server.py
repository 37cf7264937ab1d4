"""The teacher of on-policy distillation against a real built-in engine: it scores the
student's own tokens (each response token's logprob given everything before it, as the model
computes them), a scoring the engine refuses fails only its sample (counted, never a 0), and a
teacher with no engine left loses the batch as the policy's pool does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rollouts.config import EnginesConfig
from rollouts.inference.factory import make_pool
from rollouts.inference.http import EngineRequestError, EngineUnavailable
from rollouts.inference.sglang import SGLangEngine
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.teacher import Teacher
from rollouts.types import Sample, Status
from rollouts.wire.ports import free_port
from tests.hf_reference import teacher_forced_logprobs
from tests.rollout import manager_cases as cases


def constant(sample: Sample) -> float:
    return 1.0


async def test_the_teacher_scores_exactly_the_students_tokens(engine, tok, ref_model) -> None:
    """The teacher here is the student's own model: its logprob of each sampled token is the
    one the engine sampled it with (raw logits, temperature 1), and the model's own."""
    config = cases.make_config(batch_size=2, n_samples_per_prompt=2, over_sampling_factor=1.0)
    teacher = Teacher(engines=engine, max_concurrency=3)
    manager = AsyncRolloutManager(
        cases.make_buffer(), config, engine, tokenizer=tok, teacher=teacher
    )
    batch = await manager.generate_batch(constant)
    samples = [s for g in batch.groups for s in g]
    assert len(samples) == 4 and all(s.status is not Status.FAILED for s in samples)
    for s in samples:
        assert len(s.teacher_logprobs) == s.response_length > 0
        assert s.teacher_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)
        expected = teacher_forced_logprobs(
            ref_model, list(s.prompt_tokens), list(s.response_tokens)
        )
        assert s.teacher_logprobs == pytest.approx(expected.tolist(), abs=1e-4)


class RefusesOnce:
    """Fault injection: the first scoring is refused as an engine's 4xx; the rest go through."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine, self.refused = engine, 0

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> tuple[float, ...]:
        if not self.refused:
            self.refused += 1
            raise EngineRequestError(400, "injected refusal", self.engine.url)
        return await self.engine.prompt_logprobs(input_ids)


async def test_a_refused_scoring_fails_only_its_sample(engine, tok) -> None:
    config = cases.make_config(
        batch_size=2, n_samples_per_prompt=2, over_sampling_factor=1.0, max_over_sampling_rounds=1
    )
    teacher = Teacher(engines=RefusesOnce(engine), max_concurrency=1)
    manager = AsyncRolloutManager(
        cases.make_buffer(), config, engine, tokenizer=tok, teacher=teacher
    )
    batch = await manager.generate_batch(constant)
    assert batch.metadata["failures"] == {"teacher/engine_error": 1}, batch.metadata
    assert any("injected refusal" in e for e in batch.metadata["errors"])
    kept = [s for g in batch.groups for s in g]
    assert all(len(s.teacher_logprobs) == s.response_length for s in kept)
    assert all(s.status is not Status.FAILED for s in kept)  # the failed one's group is dropped
    (failed,) = batch.failed
    assert failed.reward is None and not failed.teacher_logprobs  # never a 0


async def test_a_teacher_with_no_engine_left_loses_the_batch(engine, tok) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = make_pool(EnginesConfig(wait_for_up_s=0.5, max_retries=0), [gone])
    try:
        teacher = Teacher(engines=pool)
        config = cases.make_config(batch_size=1, n_samples_per_prompt=2, over_sampling_factor=1.0)
        manager = AsyncRolloutManager(
            cases.make_buffer(), config, engine, tokenizer=tok, teacher=teacher
        )
        with pytest.raises(EngineUnavailable):
            await manager.generate_batch(constant)
    finally:
        await pool.aclose()
