"""Pairwise loss through the real PyTorch backend: token-budget micro-batches split the pairs,
and the summed gradient is still autograd's gradient of the exact pairwise loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rollouts.algorithms.batch import make_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.algorithms.pairwise import prepare_pairwise_batch
from rollouts.config import AlgorithmConfig, PairwiseConfig
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import Sample, Status
from tests.training.backend_helpers import tiny_config

PROMPT = (5, 6, 7)


def groups_of_samples() -> list[tuple[Sample, ...]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for group, rewards in enumerate([(1.0, 0.0, 0.5), (0.0, 2.0)]):
        samples = []
        for k, r in enumerate(rewards):
            response = tuple(torch.randint(3, 60, (4 + k,), generator=g).tolist())
            samples.append(
                Sample(
                    index=group,
                    group_index=group,
                    prompt="p",
                    tokens=PROMPT + response,
                    loss_mask=(0,) * len(PROMPT) + (1,) * len(response),
                    response_length=len(response),
                    reward=r,
                    status=Status.COMPLETED,
                )
            )
        out.append(tuple(samples))
    return out


def seq_logprob(lm: torch.nn.Module, sample: Sample) -> torch.Tensor:
    ids = torch.tensor(sample.tokens)
    logp = lm(ids[None]).logits[0, :-1].float().log_softmax(-1)
    token_logp = logp.gather(-1, ids[1:, None])[:, 0]
    return (token_logp * torch.tensor(sample.loss_mask[1:], dtype=torch.float32)).sum()


def test_backend_micro_batches_give_the_exact_pairwise_gradient(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir, micro_batch_tokens=10))
    groups = groups_of_samples()
    samples = [s for g in groups for s in g]
    algo = AlgorithmConfig(
        policy_loss="pairwise",
        pairwise=PairwiseConfig(beta=0.5, selector="all_pairs_above_margin"),
    )
    batch = make_train_batch(samples, [torch.zeros(len(s.tokens)) for s in samples])
    old = backend.compute_logprobs(batch).result()
    ref = tuple(
        o * 0.9 + 0.05 * m * k for k, (o, m) in enumerate(zip(old, batch.loss_mask, strict=True))
    )
    batch = dataclasses.replace(batch, old_logprobs=tuple(old), ref_logprobs=ref)
    batch = prepare_pairwise_batch(batch, groups, algo)
    metrics = backend.forward_backward(batch, make_loss_fn(algo)).result()
    lm = backend.lm
    params = [p for p in lm.parameters() if p.requires_grad]
    micro_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    backend.close()
    # the exact loss by autograd: pairs (0,1), (0,2), (2,1), (4,3)
    seq = [seq_logprob(lm, s) for s in samples]
    seq_ref = [float((r * m).sum()) for r, m in zip(ref, batch.loss_mask, strict=True)]
    pairs = [(0, 1), (0, 2), (2, 1), (4, 3)]
    deltas = torch.stack([(seq[c] - seq_ref[c]) - (seq[r] - seq_ref[r]) for c, r in pairs])
    exact = -torch.nn.functional.logsigmoid(0.5 * deltas).mean()
    exact.backward()
    exact = exact.detach()
    assert metrics["num_micro_batches"] >= 3  # pairs were split across micro-batches
    assert metrics["pairwise_loss"] == pytest.approx(float(exact), rel=1e-4)
    assert metrics["loss"] == pytest.approx(float(exact), rel=1e-4)
    assert metrics["pairs"] == pytest.approx(4.0)
    assert sum(float(g.abs().sum()) for g in micro_grads) > 0
    for got, want in zip(micro_grads, (p.grad for p in params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
