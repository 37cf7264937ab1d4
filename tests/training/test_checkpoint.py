"""Checkpoints: HF-loadable model files, exact resume, atomic writes, keep-last-K."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.trainer.checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from rollouts.trainer.factories import create_pytorch_backend
from tests.training.backend_helpers import (
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)

BATCHES = [make_batch([6, 9, 4], seed=s) for s in range(4)]


def _train(backend, steps: range) -> None:
    for s in steps:
        backend.forward_backward(BATCHES[s], nll_loss).result()
        backend.optim_step().result()


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tiny_config(tiny_model_dir)
    straight = create_pytorch_backend(config)
    _train(straight, range(4))
    expected = straight.get_weights()
    straight.close()

    first = create_pytorch_backend(config)
    _train(first, range(2))
    extra = {"buffer": {"epoch_id": 1, "partial": [[{"index": 3}]]}}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    save_checkpoint(first, tmp_path, step=2, weight_version="2", extra_state=extra)
    rng_after_save = (random.random(), np.random.rand(), torch.rand(1))
    first.close()

    second = create_pytorch_backend(config)
    state = load_checkpoint(second, find_latest_checkpoint(tmp_path))
    assert (state.step, state.weight_version, state.extra_state) == (2, "2", extra)
    assert (random.random(), np.random.rand(), torch.rand(1)) == rng_after_save
    _train(second, range(2, 4))
    resumed = second.get_weights()
    second.close()
    assert resumed.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0)


def test_checkpoint_model_loads_with_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    _train(backend, range(1))
    path = save_checkpoint(backend, tmp_path, step=1, weight_version="1")
    weights = backend.get_weights()
    backend.close()
    assert path.name == "step_000001"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and "model/model.safetensors" in manifest["files"]
    lm = AutoModelForCausalLM.from_pretrained(path / "model")
    for key, value in lm.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(path / "model").eos_token == "<|im_end|>"


def test_half_written_checkpoints_are_never_picked_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    for step in (1, 2, 3):
        save_checkpoint(backend, tmp_path, step=step, weight_version=str(step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    # a crash mid-save leaves the temporary directory: never taken, removed by the next save
    shutil.copytree(tmp_path / "step_000003", tmp_path / ".tmp-step_000004")
    # a step_ directory whose files do not match its manifest (truncated copy) is skipped
    shutil.copytree(tmp_path / "step_000003", tmp_path / "step_000005")
    with open(tmp_path / "step_000005" / "model" / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    # and one with no manifest at all
    shutil.copytree(tmp_path / "step_000003", tmp_path / "step_000006")
    (tmp_path / "step_000006" / "manifest.json").unlink()
    assert find_latest_checkpoint(tmp_path).name == "step_000003"
    save_checkpoint(backend, tmp_path, step=7, weight_version="7", keep_last=2)
    backend.close()
    assert not (tmp_path / ".tmp-step_000004").exists()
    assert find_latest_checkpoint(tmp_path).name == "step_000007"
    assert find_latest_checkpoint(tmp_path / "missing") is None
