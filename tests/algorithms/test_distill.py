"""On-policy distillation's advantages: the negative per-token reverse KL of the student's own
tokens against the teacher's, zero off the sampled tokens, optionally plus the task reward's
advantage; and what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.algorithms.advantages import (
    compute_advantages,
    distill_token_advantages,
    reverse_kl_per_token,
)
from rollouts.algorithms.loss_fn import top_k_kl
from rollouts.config import AlgorithmConfig
from rollouts.config.algorithm_tables import DistillConfig
from rollouts.types import Sample, Status


def sample(
    student: tuple[float, ...],
    teacher: tuple[float, ...],
    mask: tuple[int, ...],
    reward: float = 0.0,
    index: int = 0,
) -> Sample:
    """Two prompt tokens, then len(student) response tokens with `mask` over them."""
    n = len(student)
    return Sample(
        index=index,
        group_index=0,
        prompt="p",
        tokens=tuple(range(10, 12 + n)),
        loss_mask=(0, 0, *mask),
        response_length=n,
        rollout_logprobs=student,
        teacher_logprobs=teacher,
        reward=reward,
        status=Status.COMPLETED,
    )


def test_each_sampled_token_gets_minus_its_reverse_kl() -> None:
    s = sample((-1.0, -0.5, -2.0), (-0.25, -0.5, -3.0), (1, 1, 1))
    adv = distill_token_advantages(s, coef=1.0)
    # prompt 0, 0; then teacher - student: 0.75, 0.0, -1.0
    assert adv.tolist() == [0.0, 0.0, 0.75, 0.0, -1.0]
    assert distill_token_advantages(s, coef=2.0).tolist() == [0.0, 0.0, 1.5, 0.0, -2.0]


def test_tokens_the_student_did_not_sample_get_nothing() -> None:
    """A tool's output inside a multi-turn response (mask 0) is not the student's choice."""
    s = sample((-1.0, -9.0, -2.0), (-0.5, -0.1, -1.0), (1, 0, 1))
    assert distill_token_advantages(s, 1.0).tolist() == [0.0, 0.0, 0.5, 0.0, 1.0]
    kl, tokens = reverse_kl_per_token([[s]])
    assert tokens == 2 and kl == pytest.approx((-0.5 + -1.0) / 2)


def test_the_estimator_by_name_and_mixed_with_the_task_reward() -> None:
    a = sample((-1.0, -1.0), (-0.5, -2.0), (1, 1), reward=1.0, index=0)
    b = sample((-1.0, -1.0), (-1.0, -1.0), (1, 1), reward=0.0, index=1)
    config = AlgorithmConfig(advantage="distill")
    pure = compute_advantages([[a, b]], config)
    assert pure[0][0].tolist() == [0.0, 0.0, 0.5, -1.0]
    assert pure[0][1].tolist() == [0.0, 0.0, 0.0, 0.0]
    mixed_config = AlgorithmConfig(
        advantage="distill", distill=DistillConfig(task_advantage="grpo", task_weight=0.5)
    )
    mixed = compute_advantages([[a, b]], mixed_config)
    grpo = compute_advantages([[a, b]], AlgorithmConfig(advantage="grpo"))
    for m, p, g in zip(mixed[0], pure[0], grpo[0], strict=True):
        assert torch.allclose(m, p + 0.5 * g)
    assert float(grpo[0][0][-1]) > 0 > float(grpo[0][1][-1])  # the task part is not zero


def test_a_sample_the_teacher_did_not_score_is_refused_by_name() -> None:
    s = sample((-1.0, -1.0), (), (1, 1), index=7)
    with pytest.raises(ValueError, match=r"sample 7 .* 0 teacher_logprobs for 2 response"):
        compute_advantages([[s]], AlgorithmConfig(advantage="distill"))
    empty = sample((), (), (), index=3)  # nothing sampled: nothing to score, nothing to learn
    assert distill_token_advantages(empty, 1.0).tolist() == [0.0, 0.0]


def test_reverse_kl_is_nan_when_nothing_was_scored() -> None:
    s = sample((-1.0,), (), (1,))
    kl, tokens = reverse_kl_per_token([[s]])
    assert tokens == 0 and math.isnan(kl)


def test_the_top_k_kl_is_the_teachers_k_renormalised_against_the_students_logprobs() -> None:
    """KL(teacher_K || student) = sum_j q_j (log q_j - log p_j), q the teacher's K renormalised,
    p the student's full-vocabulary probabilities of the same K tokens."""
    teacher = torch.tensor([[[math.log(0.6), math.log(0.2)]]])  # renormalised: 0.75, 0.25
    student = torch.tensor([[[math.log(0.5), math.log(0.1)]]])
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.1)
    assert top_k_kl(teacher, student).item() == pytest.approx(expected, rel=1e-6)
    # zero where the student holds all its mass on the K in the teacher's proportions
    exact = torch.log(torch.tensor([[[0.75, 0.25]]]))
    assert top_k_kl(teacher, exact).item() == pytest.approx(0.0, abs=1e-6)
    # mass off the K costs: the same proportions at half the mass
    assert top_k_kl(teacher, exact + math.log(0.5)).item() == pytest.approx(math.log(2), rel=1e-6)


def test_with_top_k_the_sampled_tokens_advantage_is_zero_and_the_task_one_stays() -> None:
    group = [
        sample((-1.0, -2.0), (-0.1, -0.2), (1, 1), reward=r, index=i)
        for i, r in enumerate((1.0, 0.0))
    ]
    only = AlgorithmConfig(advantage="distill", distill=DistillConfig(top_k=4))
    assert all(not a.any() for a in compute_advantages([group], only)[0])
    mixed = AlgorithmConfig(
        advantage="distill", distill=DistillConfig(top_k=4, task_advantage="grpo")
    )
    task = AlgorithmConfig(advantage="grpo")
    for a, b in zip(
        compute_advantages([group], mixed)[0], compute_advantages([group], task)[0], strict=True
    ):
        assert torch.equal(a, b)
