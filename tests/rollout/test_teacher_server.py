"""The teacher of on-policy distillation against a real built-in engine: it scores the
student's own tokens (each response token's logprob given everything before it, as the model
computes them), a scoring the engine refuses fails only its sample (counted, never a 0), and a
teacher with no engine left loses the batch as the policy's pool does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from rollouts.config import EnginesConfig
from rollouts.inference.factory import make_pool
from rollouts.inference.http import EngineRequestError, EngineUnavailable
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
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


@torch.no_grad()
def hf_top(model, tokens: Sequence[int], start: int, k: int) -> list[list[tuple[int, float]]]:
    """The model's k likeliest (id, logprob) predicting each of tokens[start:]."""
    logits = model(torch.tensor([list(tokens)])).logits[0, start - 1 : -1].float()
    values, ids = logits.log_softmax(-1).topk(k, dim=-1)
    return [
        list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)
    ]


async def test_top_k_scoring_keeps_the_teachers_distribution_on_both_wires(
    engine, server, tok, ref_model
) -> None:
    """`top_k` (top-k distillation): at each response token the teacher's k likeliest tokens,
    rank order, as the model computes them, over SGLang's wire (`input_top_logprobs`) and
    vLLM's (`prompt_logprobs: k`) alike; the sampled token's logprob is kept as before."""
    config = cases.make_config(batch_size=1, n_samples_per_prompt=2, over_sampling_factor=1.0)
    k = 4
    manager = AsyncRolloutManager(
        cases.make_buffer(), config, engine, tokenizer=tok, teacher=Teacher(engines=engine, top_k=k)
    )
    batch = await manager.generate_batch(constant)
    samples = [s for g in batch.groups for s in g]
    assert len(samples) == 2
    vllm = VLLMEngine(server.url)
    try:
        for s in samples:
            assert len(s.teacher_top) == len(s.teacher_logprobs) == s.response_length > 0
            expected = hf_top(ref_model, s.tokens, s.prompt_length, k)
            for got, want in zip(s.teacher_top, expected, strict=True):
                assert [t for t, _ in got] == [t for t, _ in want]
                assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
            assert s.teacher_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)
            served, top = await vllm.prompt_top_logprobs(s.tokens, k)
            over_vllm = top[s.prompt_length - 1 :]
            # from the response's first token on: the same entries, over both wires
            tail, tail_top = await vllm.prompt_top_logprobs(s.tokens, k, s.prompt_length)
            assert (tail, tail_top) == (served[s.prompt_length - 1 :], over_vllm)
            whole, whole_top = await engine.prompt_top_logprobs(s.tokens, k)
            assert whole[s.prompt_length - 1 :] == pytest.approx(s.teacher_logprobs, abs=1e-5)
            assert [[t for t, _ in step] for step in whole_top[s.prompt_length - 1 :]] == [
                [t for t, _ in step] for step in s.teacher_top
            ]
            assert [[t for t, _ in step] for step in over_vllm] == [
                [t for t, _ in step] for step in s.teacher_top
            ]
            flat = [lp for step in over_vllm for _, lp in step]
            assert flat == pytest.approx([lp for step in s.teacher_top for _, lp in step], abs=1e-5)
            assert served[s.prompt_length - 1 :] == pytest.approx(s.teacher_logprobs, abs=1e-5)
    finally:
        await vllm.aclose()


class RefusesOnce:
    """Fault injection: the first scoring is refused as an engine's 4xx; the rest go through."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine, self.refused = engine, 0

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> tuple[float, ...]:
        if not self.refused:
            self.refused += 1
            raise EngineRequestError(400, "injected refusal", self.engine.url)
        return await self.engine.prompt_logprobs(input_ids, start)


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
