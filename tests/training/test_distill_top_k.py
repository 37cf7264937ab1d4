"""Top-k distillation in the trainer (`algorithm.distill.top_k`): the backend scores the
teacher's K tokens at every trained position, in every micro-batch layout, as the model's own
log-softmax gives them; and the loss's KL(teacher_K || student) falls as the student learns."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollouts.algorithms.batch import build_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import AlgorithmConfig
from rollouts.config.algorithm_tables import DistillConfig
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import ModelOutputs, PlainLoss, Sample, Status, TrainBatch
from tests.training.backend_helpers import nll_loss, one_torch_thread, tiny_config  # noqa: F401
from tests.training.test_prefix_layout import grpo_batch

K = 3


def with_teacher_top(batch: TrainBatch, seed: int = 0, vocab: int = 200) -> TrainBatch:
    """`batch` with K distinct random teacher tokens and a random distribution at each position."""
    g = torch.Generator().manual_seed(seed)
    ids, lps = [], []
    for seq in batch.input_ids:
        n = int(seq.shape[0])
        ids.append(torch.stack([torch.randperm(vocab - 3, generator=g)[:K] + 3 for _ in range(n)]))
        lps.append(torch.log_softmax(torch.randn(n, K, generator=g), dim=-1))
    return dataclasses.replace(batch, teacher_top_ids=tuple(ids), teacher_top_logprobs=tuple(lps))


@pytest.mark.parametrize("layout", ["pad", "prefix"])
def test_the_backend_scores_the_teachers_tokens_in_every_layout(
    tiny_model_dir: Path, layout: str
) -> None:
    batch = with_teacher_top(grpo_batch(seed=3))
    config = tiny_config(tiny_model_dir, micro_batch_layout=layout, micro_batch_tokens=64)
    scored: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a sequence, its top-K logprobs)

    def keep(outputs: ModelOutputs, b: TrainBatch):
        scored.extend(zip(b.input_ids, (t.detach() for t in outputs.top_logprobs), strict=True))
        return nll_loss(outputs, b)

    backend = create_pytorch_backend(config)
    metrics = backend.forward_backward(batch, PlainLoss(fn=keep)).result()
    backend.close()
    assert metrics["num_micro_batches"] > 1 and len(scored) == len(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for seq, mask, top in zip(
            batch.input_ids, batch.loss_mask, batch.teacher_top_ids, strict=True
        ):
            (got,) = [t for s, t in scored if torch.equal(s, seq)]
            logp = model(seq[None]).logits[0, :-1].float().log_softmax(-1)
            want = torch.zeros(len(seq), K)
            want[1:] = logp.gather(-1, top[1:])
            want[mask == 0] = 0.0  # untrained positions are not scored
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _sample(index: int, prompt: list[int], response: list[int], top) -> Sample:
    return Sample(
        index=index,
        group_index=0,
        prompt="p",
        tokens=tuple(prompt + response),
        loss_mask=(0,) * len(prompt) + (1,) * len(response),
        response_length=len(response),
        rollout_logprobs=(-1.0,) * len(response),
        teacher_logprobs=(-1.0,) * len(response),
        teacher_top=tuple(top for _ in response),
        reward=0.0,
        status=Status.COMPLETED,
    )


def test_top_k_distillation_moves_the_student_to_the_teachers_distribution(
    tiny_model_dir: Path,
) -> None:
    """Teacher-scored samples whose every position says tokens 40, 41, 42 at 0.7 / 0.2 / 0.1:
    the loss (the distill config's, through the backend) falls step after step, and the
    student's probabilities of the three approach the teacher's."""
    top = ((40, math.log(0.7)), (41, math.log(0.2)), (42, math.log(0.1)))
    group = tuple(_sample(i, [5, 6, 7, 8], [9 + i, 20, 30 + i, 11], top) for i in range(4))
    algorithm = AlgorithmConfig(advantage="distill", distill=DistillConfig(top_k=K))
    batch = build_train_batch([group], algorithm)
    assert [tuple(t.shape) for t in batch.teacher_top_ids] == [(8, K)] * 4
    loss_fn = make_loss_fn(algorithm)
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    probe = TrainBatch(  # p(token 40 | the prompt)
        input_ids=(torch.tensor([5, 6, 7, 8, 40]),),
        loss_mask=(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]),),
        num_global_tokens=1.0,
        num_global_seqs=1.0,
    )
    before = math.exp(float(backend.compute_logprobs(probe).result()[0][-1]))
    kls = []
    for _ in range(6):
        metrics = backend.forward_backward(batch, loss_fn).result()
        backend.optim_step().result()
        kls.append(metrics["top_k_kl"])
    after = math.exp(float(backend.compute_logprobs(probe).result()[0][-1]))
    backend.close()
    assert all(b < a for a, b in itertools.pairwise(kls)), kls
    assert kls[-1] < 0.5 * kls[0], kls
    assert after > 10 * before, (before, after)
