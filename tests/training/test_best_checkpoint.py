"""The best checkpoint (by a step metric) is recorded in best.json and survives keep-last-K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollouts.config import CheckpointConfig, ConfigError
from rollouts.trainer.checkpoint import (
    BEST_FILE,
    BestSpec,
    checkpoint_name,
    find_best_checkpoint,
    find_latest_checkpoint,
    is_better,
    list_checkpoints,
    load_checkpoint,
    read_best,
    save_checkpoint,
)
from rollouts.trainer.factories import create_pytorch_backend
from tests.training.backend_helpers import one_torch_thread, tiny_config  # noqa: F401


def test_is_better() -> None:
    assert is_better(0.5, None, "max") and is_better(0.5, None, "min")
    assert is_better(0.6, 0.5, "max") and not is_better(0.5, 0.5, "max")
    assert is_better(0.4, 0.5, "min") and not is_better(0.6, 0.5, "min")
    assert not is_better(float("nan"), None, "max")


def test_best_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match="checkpoint.best_mode"):
        CheckpointConfig(best_mode="up")


def test_best_checkpoint_survives_keep_last_rotation(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    root = tmp_path / "rl"
    accuracy = {1: 0.2, 2: 0.7, 3: 0.5, 4: None, 5: 0.6}  # None: no eval at that step
    best = BestSpec(metric="eval/accuracy", mode="max")
    try:
        for step, acc in accuracy.items():
            metrics = {"train/loss": 1.0} | ({} if acc is None else {"eval/accuracy": acc})
            save_checkpoint(
                backend, root, step=step, weight_version=str(step), keep_last=1,
                metrics=metrics, best=best,
            )  # fmt: skip
    finally:
        backend.close()
    names = [p.name for p in list_checkpoints(root)]
    assert names == [checkpoint_name(2), checkpoint_name(5)]  # the best and the last one
    record = json.loads((root / BEST_FILE).read_text())
    assert record == {
        "step": 2, "name": checkpoint_name(2), "metric": "eval/accuracy", "value": 0.7,
        "mode": "max",
    }  # fmt: skip
    assert find_best_checkpoint(root) == root / checkpoint_name(2)
    assert find_latest_checkpoint(root) == root / checkpoint_name(5)  # resume uses the latest
    fresh = create_pytorch_backend(tiny_config(tiny_model_dir))
    try:
        assert load_checkpoint(fresh, find_best_checkpoint(root)).step == 2
    finally:
        fresh.close()


def test_a_new_best_releases_the_old_one_and_min_mode(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    root = tmp_path / "rl"
    best = BestSpec(metric="eval/loss", mode="min")
    try:
        for step, loss in enumerate([0.9, 0.5, 0.8, 0.3, 0.4], start=1):
            save_checkpoint(
                backend, root, step=step, weight_version=str(step), keep_last=1,
                metrics={"eval/loss": loss}, best=best,
            )  # fmt: skip
            assert (read_best(root) or {}).get("value") == min([0.9, 0.5, 0.8, 0.3, 0.4][:step])
        # no best tracking: the plain rotation still keeps the recorded best
        save_checkpoint(backend, root, step=6, weight_version="6", keep_last=1)
    finally:
        backend.close()
    assert [p.name for p in list_checkpoints(root)] == [checkpoint_name(4), checkpoint_name(6)]
    assert find_best_checkpoint(root) == root / checkpoint_name(4)
