"""No redundant forward: an on-policy update takes its old logprobs from the training forward.

One RL step with the separate no-grad pass (`recompute_old_logprobs = "always"`) and one without
("auto") must give the same loss, gradients and updated weights (the ratio is 1 either way), and
still report the engine/trainer mismatch and apply TIS from that same forward.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from rollouts.algorithms.algorithm import needs_old_logprobs_pass
from rollouts.algorithms.batch import make_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import AlgorithmConfig, Config, RolloutCorrectionConfig
from rollouts.loop.rl import train_step
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import Sample, Status
from tests.training.backend_helpers import one_torch_thread, tiny_config  # noqa: F401

PROMPT = (5, 6, 7)


def scored_groups() -> tuple[tuple[Sample, ...], ...]:
    """Two groups of four samples with rewards and (made-up) engine logprobs."""
    g = torch.Generator().manual_seed(3)
    out = []
    for group, rewards in enumerate([(1.0, 0.0, 1.0, 0.0), (0.0, 1.0, 0.0, 0.0)]):
        samples = []
        for k, r in enumerate(rewards):
            response = tuple(torch.randint(3, 60, (4 + k,), generator=g).tolist())
            engine_lp = tuple((-torch.rand(len(response), generator=g) * 4.0).tolist())
            samples.append(
                Sample(
                    index=group,
                    group_index=group,
                    prompt="p",
                    tokens=PROMPT + response,
                    loss_mask=(0,) * len(PROMPT) + (1,) * len(response),
                    response_length=len(response),
                    rollout_logprobs=engine_lp,
                    reward=r,
                    status=Status.COMPLETED,
                )
            )
        out.append(tuple(samples))
    return tuple(out)


class CountingBackend:
    """The real backend, counting the separate old-logprob passes the loop asks for."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logprob_passes = 0

    def compute_logprobs(self, batch: Any) -> Any:
        self.logprob_passes += 1
        return self.inner.compute_logprobs(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def config_with(model_dir: Path, tis: bool = False, tis_cap: float = 2.0, **algo: Any) -> Config:
    base = tiny_config(model_dir, micro_batch_tokens=24)  # several micro-batches per update
    correction = RolloutCorrectionConfig(tis=tis, tis_cap=tis_cap)
    return dataclasses.replace(
        base, algorithm=AlgorithmConfig(rollout_correction=correction, **algo)
    )


async def one_step(config: Config) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    backend = CountingBackend(create_pytorch_backend(config))
    try:
        trained = await train_step(backend, scored_groups(), config.algorithm, config, None)
        metrics = trained.metrics
        weights = backend.get_weights()
    finally:
        backend.close()
    return metrics, weights, backend.logprob_passes


@pytest.mark.parametrize("tis", [False, True])
async def test_on_policy_step_without_the_separate_pass_is_the_same_step(
    tiny_model_dir: Path, tis: bool
) -> None:
    common = {"tis": tis, "tis_cap": 1.5}
    with_pass, w_with, n_with = await one_step(
        config_with(tiny_model_dir, recompute_old_logprobs="always", **common)
    )
    without, w_without, n_without = await one_step(
        config_with(tiny_model_dir, recompute_old_logprobs="auto", **common)
    )
    assert (n_with, n_without) == (1, 0)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/logprob_mismatch"):
        assert without[key] == pytest.approx(with_pass[key], rel=1e-5, abs=1e-7), key
    assert without["train/ratio_abs_dev"] == 0.0  # exactly 1: old is the forward's own
    assert with_pass["train/ratio_abs_dev"] < 1e-6
    assert without["train/logprob_mismatch"] > 0.1  # the made-up engine logprobs are far off
    if tis:
        assert without["train/tis_weight_mean"] == pytest.approx(with_pass["train/tis_weight_mean"])
    assert w_with.keys() == w_without.keys()
    for name, value in w_with.items():
        torch.testing.assert_close(w_without[name], value, rtol=1e-5, atol=1e-7)


def test_gradients_match_with_and_without_old_logprobs(tiny_model_dir: Path) -> None:
    config = config_with(tiny_model_dir, tis=True)
    backend = create_pytorch_backend(config)
    samples = [s for g in scored_groups() for s in g]
    advantages = [torch.linspace(-1.0, 1.0, len(s.tokens)) for s in samples]
    batch = make_train_batch(samples, advantages)
    loss_fn = make_loss_fn(config.algorithm)
    params = [p for p in backend.lm.parameters() if p.requires_grad]
    try:
        old = backend.compute_logprobs(batch).result()
        given = dataclasses.replace(batch, old_logprobs=tuple(old))
        m_given = backend.forward_backward(given, loss_fn).result()
        grads_given = [p.grad.clone() for p in params]
        backend.lm.zero_grad(set_to_none=True)
        m_own = backend.forward_backward(batch, loss_fn).result()
        grads_own = [p.grad.clone() for p in params]
    finally:
        backend.close()
    assert m_own["loss"] == pytest.approx(m_given["loss"], rel=1e-6)
    assert m_own["logprob_mismatch"] == pytest.approx(m_given["logprob_mismatch"], rel=1e-6)
    for a, b in zip(grads_own, grads_given, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_the_separate_pass_is_kept_where_it_is_needed() -> None:
    auto = AlgorithmConfig()
    assert not needs_old_logprobs_pass(auto, 1)
    assert needs_old_logprobs_pass(auto, 2)  # later mini-batches follow an optimizer step
    assert needs_old_logprobs_pass(dataclasses.replace(auto, ppo_epochs=2), 1)
    assert needs_old_logprobs_pass(dataclasses.replace(auto, recompute_old_logprobs="always"), 1)
    pairwise = AlgorithmConfig(policy_loss="pairwise")
    assert needs_old_logprobs_pass(pairwise, 1)  # the pairs' margins need them before the update
    with pytest.raises(ValueError, match="recompute_old_logprobs"):
        AlgorithmConfig(recompute_old_logprobs="never")
