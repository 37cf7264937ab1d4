"""The LM head runs only on trained tokens (`training.logprob_positions = "trained"`): the same
loss, gradients, metrics and trained-token logprobs as running it everywhere ("all")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rollouts.config import Config, ConfigError
from rollouts.trainer.batching import build_tensors, plan_micro_batches
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import ModelOutputs, PlainLoss, TrainBatch
from tests.training.backend_helpers import (  # noqa: F401
    LENGTHS,
    nll_loss,
    one_torch_thread,
    tiny_config,
)


def prompt_masked_batch(lengths: list[int], seed: int = 0, vocab: int = 200) -> TrainBatch:
    """Random sequences with an untrained prompt (a third of each), an untrained span in the
    middle of the longer ones (a tool's output) and one sequence with nothing trained at all."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i, n in enumerate(lengths):
        ids.append(torch.randint(3, vocab, (n,), generator=g))
        mask = torch.zeros(n)
        if i != 2:  # sequence 2 trains nothing
            mask[max(1, n // 3) :] = 1.0
        if n >= 9:
            mask[n - 4 : n - 2] = 0.0
        masks.append(mask)
    return TrainBatch(
        input_ids=tuple(ids),
        loss_mask=tuple(masks),
        num_global_tokens=float(sum(m.sum() for m in masks)),
        num_global_seqs=float(len(lengths)),
    )


def with_positions(config: Config, positions: str, **training) -> Config:
    t = dataclasses.replace(config.training, logprob_positions=positions, **training)
    return dataclasses.replace(config, training=t)


def test_the_head_indices_are_the_trained_targets_in_both_layouts() -> None:
    batch = prompt_masked_batch(LENGTHS)
    for layout in ("pad", "pack"):
        for plan in plan_micro_batches(LENGTHS, 16, layout):
            mb = build_tensors(plan, batch.input_ids, 0, batch.loss_mask)
            expected = torch.cat([batch.loss_mask[i][1:] for i in plan.indices]).nonzero()
            assert mb.head_idx is not None
            assert mb.head_idx.tolist() == expected.squeeze(-1).tolist()
    all_trained = [torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in LENGTHS]
    plan = plan_micro_batches(LENGTHS, 1000, "pad")[0]
    assert build_tensors(plan, batch.input_ids, 0, all_trained).head_idx is None
    assert build_tensors(plan, batch.input_ids, 0).head_idx is None


def _step(config: Config, batch: TrainBatch):
    backend = create_pytorch_backend(config)
    seen: list[tuple[ModelOutputs, TrainBatch]] = []

    def loss_fn(outputs: ModelOutputs, b: TrainBatch):
        seen.append((outputs, b))
        loss, metrics = nll_loss(outputs, b)
        ent = sum((e.detach() * m).sum() for e, m in zip(outputs.entropy, b.loss_mask, strict=True))
        return loss, {**metrics, "entropy_sum": float(ent)}

    metrics = backend.forward_backward(batch, PlainLoss(fn=loss_fn), entropy=True).result()
    grads = {n: p.grad.clone() for n, p in backend.lm.named_parameters()}
    logprobs = backend.compute_logprobs(batch).result()
    backend.close()
    return metrics, grads, logprobs, seen


@pytest.mark.parametrize(
    "training",
    [
        {"micro_batch_tokens": 20},
        {"micro_batch_tokens": 16, "micro_batch_layout": "pack", "logprob_chunk_size": 3},
    ],
)
def test_trained_only_head_gives_the_same_loss_gradients_and_logprobs(
    tiny_model_dir: Path, training: dict
) -> None:
    batch = prompt_masked_batch(LENGTHS, seed=3)
    base = tiny_config(tiny_model_dir)
    m_all, g_all, lp_all, _ = _step(with_positions(base, "all", **training), batch)
    m_tr, g_tr, lp_tr, seen = _step(with_positions(base, "trained", **training), batch)
    assert m_tr["loss"] == pytest.approx(m_all["loss"], rel=1e-5)
    assert m_tr["entropy_sum"] == pytest.approx(m_all["entropy_sum"], rel=1e-5)
    assert m_tr["loss"] > 0.0
    for name, grad in g_all.items():
        torch.testing.assert_close(g_tr[name], grad, atol=1e-6, rtol=1e-4)
    assert g_tr["lm_head.weight"].abs().sum() > 0
    # trained tokens: the same logprobs; the others were never computed and read 0
    for mask, a, t in zip(batch.loss_mask, lp_all, lp_tr, strict=True):
        trained = mask != 0
        torch.testing.assert_close(t[trained], a[trained], atol=1e-5, rtol=1e-5)
        assert (t[~trained] == 0.0).all()
        assert (a[1:][~trained[1:]] != 0.0).all()  # "all" does compute them
    for outputs, b in seen:  # the entropy metric too: only where trained
        for ent, mask in zip(outputs.entropy, b.loss_mask, strict=True):
            assert (ent[mask == 0] == 0.0).all() and (ent[mask != 0] > 0.0).all()


def test_a_micro_batch_with_nothing_trained_runs_and_trains_nothing(tiny_model_dir: Path) -> None:
    ids = (torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11]))
    batch = TrainBatch(
        input_ids=ids,
        loss_mask=(torch.zeros(4), torch.zeros(3)),
        num_global_tokens=1.0,
        num_global_seqs=2.0,
    )
    metrics, grads, logprobs, _ = _step(tiny_config(tiny_model_dir), batch)
    assert metrics["loss"] == 0.0
    assert all((g == 0).all() for g in grads.values())
    assert all((lp == 0).all() and lp.shape == i.shape for lp, i in zip(logprobs, ids, strict=True))


def test_a_bad_logprob_positions_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"training.logprob_positions = 'prompt'.*'trained'"):
        with_positions(Config(), "prompt")
