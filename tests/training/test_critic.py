"""The critic (value head on the policy) through the real PyTorch backend and the RL train step:
values aligned like logprobs, the value loss falls, PPO epochs move the ratio, checkpoints keep
the head and the HF export never holds it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rollouts.algorithms.batch import make_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import AlgorithmConfig, Config, GAEConfig
from rollouts.loop.rl import train_step
from rollouts.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.model import VALUE_HEAD_FILE
from rollouts.trainer.pytorch import MODEL_DIR, load_hf_weights
from rollouts.types import Sample, Status
from tests.training.backend_helpers import one_torch_thread, tiny_config  # noqa: F401

PROMPT = (5, 6, 7)


def groups_of_samples() -> tuple[tuple[Sample, ...], ...]:
    g = torch.Generator().manual_seed(1)
    out = []
    for group, rewards in enumerate([(1.0, 0.0, 1.0, 0.0), (0.0, 1.0, 0.0, 0.0)]):
        samples = []
        for k, r in enumerate(rewards):
            response = tuple(torch.randint(3, 60, (5 + k,), generator=g).tolist())
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
    return tuple(out)


def gae_config(model_dir: Path, gae: dict | None = None, **algo: object) -> Config:
    base = tiny_config(model_dir, micro_batch_tokens=64)
    critic = GAEConfig(**{"lam": 0.95, "value_clip": 10.0, **(gae or {})})
    return dataclasses.replace(base, algorithm=AlgorithmConfig(advantage="gae", gae=critic, **algo))


def test_values_are_aligned_like_logprobs(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(gae_config(tiny_model_dir))
    try:
        with torch.no_grad():  # a non-zero head, so values differ between positions
            backend.value_head.weight.normal_(0.0, 0.5)
        samples = [s for g in groups_of_samples() for s in g][:2]
        batch = make_train_batch(samples, [torch.zeros(len(s.tokens)) for s in samples])
        values = backend.compute_values(batch).result()
        assert [len(v) for v in values] == [len(s.tokens) for s in samples]
        assert all(float(v[0]) == 0.0 for v in values)
        # V at t sees tokens < t only: changing the last token leaves every value unchanged
        ids = list(samples[0].tokens)
        ids[-1] = 3 if ids[-1] != 3 else 4
        changed = dataclasses.replace(batch, input_ids=(torch.tensor(ids), *batch.input_ids[1:]))
        again = backend.compute_values(changed).result()
        torch.testing.assert_close(again[0], values[0])
        assert len(set(values[0][1:].tolist())) > 1
    finally:
        backend.close()


def test_value_loss_falls_on_a_fixed_batch(tiny_model_dir: Path) -> None:
    config = gae_config(tiny_model_dir, gae={"value_coef": 1.0, "value_lr": 1e-2})
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-3))
    backend = create_pytorch_backend(config)
    samples = [s for g in groups_of_samples() for s in g]
    batch = make_train_batch(samples, [torch.zeros(len(s.tokens)) for s in samples])
    returns = tuple(m * float(s.reward) for m, s in zip(batch.loss_mask, samples, strict=True))
    loss_fn = make_loss_fn(config.algorithm)
    assert loss_fn.needs_values
    losses = []
    try:
        for _ in range(6):
            old = backend.compute_logprobs(batch).result()
            values = backend.compute_values(batch).result()
            step = dataclasses.replace(
                batch, old_logprobs=tuple(old), old_values=tuple(values), returns=returns
            )
            losses.append(backend.forward_backward(step, loss_fn).result()["value_loss"])
            backend.optim_step().result()
    finally:
        backend.close()
    assert losses[-1] < 0.5 * losses[0], f"{losses=}"


async def test_ppo_epochs_move_the_ratio_and_the_clip_fraction(tiny_model_dir: Path) -> None:
    config = gae_config(tiny_model_dir, ppo_epochs=3, clip_eps_low=0.05, clip_eps_high=0.05)
    backend = create_pytorch_backend(config)
    try:
        trained = await train_step(backend, groups_of_samples(), config.algorithm, config, None)
        metrics, times = trained.metrics, trained.times
    finally:
        backend.close()
    assert metrics["train/updates"] == 3.0
    assert metrics["train/clipfrac_epoch0"] == 0.0
    assert metrics["train/ratio_abs_dev_epoch0"] < 1e-5
    assert metrics["train/clipfrac_epoch1"] > 0.0
    assert metrics["train/clipfrac_epoch2"] > 0.0
    assert metrics["train/ratio_abs_dev_epoch2"] > metrics["train/ratio_abs_dev_epoch1"] > 0.0
    assert "train/value_loss" in metrics and "values" in times


def test_value_head_checkpoint_round_trip_and_not_in_hf_export(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = gae_config(tiny_model_dir)
    backend = create_pytorch_backend(config)
    try:
        with torch.no_grad():
            backend.value_head.weight.normal_(0.0, 0.5)
            backend.value_head.bias.fill_(0.25)
        saved = {k: v.clone() for k, v in backend.value_head.state_dict().items()}
        path = save_checkpoint(backend, tmp_path / "ckpt", step=3, weight_version="3")
        backend.save_weights(tmp_path / "export").result()
        exported = backend.get_weights()
    finally:
        backend.close()
    assert (path / VALUE_HEAD_FILE).is_file()
    for weights in (
        exported,
        load_hf_weights(tmp_path / "export"),
        load_hf_weights(path / MODEL_DIR),
    ):
        assert weights and not any("value" in k for k in weights), sorted(weights)[:5]
    fresh = create_pytorch_backend(config)
    try:
        assert float(fresh.value_head.weight.detach().abs().sum()) == 0.0  # zero-initialised
        state = load_checkpoint(fresh, path)
        assert state.step == 3
        for key, value in fresh.value_head.state_dict().items():
            torch.testing.assert_close(value, saved[key])
    finally:
        fresh.close()
