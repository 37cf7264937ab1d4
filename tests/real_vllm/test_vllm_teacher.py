"""A distillation teacher served by the real vLLM (CPU build): it passes the teacher's start
check against SmolLM2's directory, and its logprobs of a student's tokens, and its top-k at each
of them (`prompt_logprobs: k`, top-k distillation), equal those of the same model served by the
built-in engine, within 1e-4 in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import AlgorithmConfig, Config, EnginesConfig
from rollouts.config.served import TeacherConfig
from rollouts.driver.served import check_served_engines
from rollouts.engine.launch import engine_server
from rollouts.inference.factory import make_pool
from rollouts.inference.sglang import SGLangEngine
from rollouts.rollout.teacher import Teacher
from rollouts.trainer.building import load_tokenizer
from rollouts.types import Sample, Status
from rollouts.weights.check import largest_gap
from tests.real_vllm.conftest import VLLMServer
from tests.real_vllm.test_vllm_training import FP32_MATCH

pytestmark = pytest.mark.smollm2  # on the "smollm2" server (conftest.py)

TOP_K = 5
ANSWERS = [
    ("What is 17 + 25?", "17 + 25 = 42"),
    ("What is 3 + 29?", "3 + 29 = 31"),  # wrong: a student samples those too
    ("What is 8 + 8?", "The sum of 8 and 8 is 16."),
    ("What is 30 + 1?", "31"),
]


def _samples(model: Path) -> list[Sample]:
    """Chat prompts and answers as a student's finished samples."""
    tok = load_tokenizer(model)
    out = []
    for i, (question, answer) in enumerate(ANSWERS):
        messages = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(getattr(prompt, "input_ids", prompt))
        response = tok.encode(answer, add_special_tokens=False)
        out.append(
            Sample(
                index=i,
                group_index=0,
                prompt=question,
                tokens=(*prompt, *response),
                loss_mask=(0,) * len(prompt) + (1,) * len(response),
                response_length=len(response),
                status=Status.COMPLETED,
            )
        )
    return out


async def test_a_vllm_teacher_scores_as_the_builtin_one(
    vllm: dict[str, VLLMServer], model_dirs: dict[str, Path]
) -> None:
    model = model_dirs["smollm2"]
    engines = EnginesConfig(kind="vllm", urls=[vllm["smollm2"].url])
    teacher = TeacherConfig(path=str(model), engines=engines)
    config = Config(algorithm=AlgorithmConfig(advantage="distill"), teacher=teacher)
    pool = make_pool(engines, engines.urls)
    try:
        # another test may have left trained weights there: the teacher's own first
        await pool.engines[0].update_weights_from_disk(str(model), "teacher")
        await check_served_engines(config, teacher, pool, model)  # the start check, through vLLM
        samples = _samples(model)
        # one at a time: this server runs with --enable-lora, and vLLM 0.32's CPU build dies on
        # two prompt-logprobs requests in one batch with LoRA on ("einsum(): subscript b has
        # size 4 ... 40"); a teacher's own server needs no LoRA and takes them together
        by_vllm = await Teacher(engines=pool, max_concurrency=1, top_k=TOP_K).score_group(samples)
        async with engine_server(model, dtype="float32") as url:
            builtin = SGLangEngine(url)
            try:
                by_builtin = await Teacher(engines=builtin, top_k=TOP_K).score_group(samples)
            finally:
                await builtin.aclose()
    finally:
        await pool.aclose()
    for a, b in zip(by_vllm, by_builtin, strict=True):
        assert a.status is Status.COMPLETED, a.metadata
        assert len(a.teacher_logprobs) == a.response_length > 0
        gap, _ = largest_gap(a.teacher_logprobs, b.teacher_logprobs)
        assert gap < FP32_MATCH, (gap, a.teacher_logprobs, b.teacher_logprobs)
        print(f"[teacher] vLLM against the built-in engine: largest gap {gap:.2g}")
        assert len(a.teacher_top) == len(b.teacher_top) == a.response_length
        for at, bt in zip(a.teacher_top, b.teacher_top, strict=True):
            assert len(at) == len(bt) == TOP_K
            for (ta, la), (tb, lb) in zip(at, bt, strict=True):
                assert abs(la - lb) < FP32_MATCH, (at, bt)  # rank by rank
                if ta != tb:  # the same tokens, unless two of them tie within the bound
                    assert abs(la - dict(bt).get(ta, la + 1)) < FP32_MATCH, (at, bt)
