"""A resumed run trains against the same reference model as an uninterrupted one (issue 17).

Every reference update mode on real backends and real checkpoints: 4 policy steps straight
through, against 2 steps, a checkpoint, a fresh process state (reference rebuilt from the base
model, as `--resume` does) restored from it, and 2 more steps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import trio

from rollouts.config import AlgorithmConfig, KLConfig, ReferenceConfig, config_from_dict
from rollouts.driver.quick_start import quick_start_training
from rollouts.driver.reference_setup import build_reference, restore_reference
from rollouts.driver.rl_phase import rl_phase
from rollouts.driver.setup import StopFlag
from rollouts.trainer.checkpoint import (
    REFERENCE_FILE,
    find_latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rollouts.trainer.factories import create_backend
from tests.training.backend_helpers import (
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)

BATCHES = [make_batch([6, 9, 4], seed=s) for s in range(4)]


def half_way(ref, policy, step):
    """A user strategy: halfway between the reference and the policy."""
    return {k: (ref[k].detach() + policy[k].detach()) / 2 for k in ref}


MODES = {
    "copy": {},
    "ema": {"ema_decay": 0.5},
    "periodic": {"update_every": 2},
    "user": {"update_fn": "tests.training.test_reference_resume.half_way"},
}


def _config(model_dir: Path, mode: str):
    config = tiny_config(model_dir)
    algo = AlgorithmConfig(
        kl=KLConfig(coef=0.1), reference=ReferenceConfig(update=mode, **MODES[mode])
    )
    return dataclasses.replace(config, algorithm=algo)


async def _steps(policy, ref, algo, steps: range) -> None:
    for s in steps:
        policy.forward_backward(BATCHES[s], nll_loss).result()
        policy.optim_step().result()
        await ref.update(policy, algo, s + 1)


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_resume_restores_the_reference_model(
    mode: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, mode)
    algo = config.algorithm
    policy = create_backend(config, model_path=tiny_model_dir, total_steps=10)
    ref = build_reference(config, tiny_model_dir)
    await _steps(policy, ref, algo, range(2))
    at_2 = {k: v.detach().clone() for k, v in ref.backend.get_weights().items()}
    await _steps(policy, ref, algo, range(2, 4))
    expected = {k: v.detach().clone() for k, v in ref.backend.get_weights().items()}
    policy.close()
    ref.backend.close()

    policy = create_backend(config, model_path=tiny_model_dir, total_steps=10)
    ref = build_reference(config, tiny_model_dir)
    await _steps(policy, ref, algo, range(2))
    path = save_checkpoint(
        policy, tmp_path, step=2, weight_version="2", reference=ref.params_to_checkpoint()
    )
    assert (path / REFERENCE_FILE).is_file()
    policy.close()
    ref.backend.close()

    policy = create_backend(config, model_path=tiny_model_dir, total_steps=10)
    ref = build_reference(config, tiny_model_dir)  # the base model, as --resume builds it
    latest = find_latest_checkpoint(tmp_path)
    load_checkpoint(policy, latest)
    assert restore_reference(ref, latest)
    restored = ref.backend.get_weights()  # what the first resumed step's KL is taken against
    for key in at_2:
        torch.testing.assert_close(restored[key], at_2[key], rtol=0, atol=0)
    await _steps(policy, ref, algo, range(2, 4))
    resumed = ref.backend.get_weights()
    policy.close()
    ref.backend.close()
    assert resumed.keys() == expected.keys()
    base = create_backend(config, model_path=tiny_model_dir, total_steps=1).get_weights()
    assert any(not torch.equal(at_2[k], base[k]) for k in at_2)  # it had moved by step 2
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0)


def test_a_reference_that_never_moved_is_not_saved(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = _config(tiny_model_dir, "periodic")  # every 2 steps: nothing moved at step 1
    ref = build_reference(config, tiny_model_dir)
    assert ref.params_to_checkpoint() is None
    policy = create_backend(config, model_path=tiny_model_dir, total_steps=10)
    path = save_checkpoint(policy, tmp_path, step=1, weight_version="1", reference=None)
    assert not (path / REFERENCE_FILE).exists()
    assert not restore_reference(ref, path)
    policy.close()
    ref.backend.close()


def test_the_driver_saves_and_restores_the_reference(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver's wiring (rl_phase, as train.py runs it): RL checkpoints carry the moved
    reference and a resume loads it."""
    overrides = {
        "algorithm": {"kl": {"coef": 0.05}, "reference": {"update": "ema", "ema_decay": 0.5}},
        "rollout": {"batch_size": 1, "n_samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}},
        "logging": {"console": False},
    }
    prompts = ["1+1=", "2+2=", "3+3="]
    first = quick_start_training(
        tiny_model_dir, prompts, reward_len, 1, output_dir=tmp_path, overrides=overrides
    )
    assert first.checkpoint is not None
    assert (first.checkpoint / REFERENCE_FILE).is_file()
    config = config_from_dict(json.loads((tmp_path / "config.json").read_text())["config"])
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, rl_steps=2))
    trio.run(rl_phase, config, tmp_path, tiny_model_dir, True, StopFlag(), reward_len)
    assert f"reference model restored from {first.checkpoint}" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "rl" / "step_000002" / REFERENCE_FILE).is_file()


def reward_len(sample) -> float:
    return float(sample.response_length % 2)
