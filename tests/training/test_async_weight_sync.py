"""Async mode: the engines load step k's weights while step k+1 trains (the delivery overlaps
the next step), every batch stays within the staleness bound and trains its full batch_size of
groups, and a delivery that fails stops the run in the next step, before that step's
checkpoint."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from rollouts.driver.quick_start import quick_start_training
from rollouts.inference.pool import EnginePool
from rollouts.inference.sync import Delivery, EngineSyncResult, SyncReport, WeightSyncError
from rollouts.trainer.pytorch import PyTorchBackend, load_hf_weights
from rollouts.types import Sample

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

PROMPTS = [f"{a}+{a}=" for a in range(10, 30)]


def reward_len_mod_2(sample: Sample) -> float:
    return float(sample.response_length % 2)


def reward_last_token_parity(sample: Sample) -> float:
    return float(sample.tokens[-1] % 2)  # varies within a group: nonzero advantages


def _overrides(**extra: Any) -> dict[str, Any]:
    return {
        "rollout": {
            "mode": "async",
            "batch_size": 2,
            "n_samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 8},
        },
        "logging": {"console": False},
        **extra,
    }


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def test_async_engines_load_weights_while_the_next_step_trains(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[str] = []
    real_sync = EnginePool.sync

    async def sync(pool: EnginePool, delivery: Any) -> SyncReport:
        pauses.append(delivery.options.pause)
        return await real_sync(pool, delivery)

    monkeypatch.setattr(EnginePool, "sync", sync)
    result = quick_start_training(
        tiny_model_dir,
        PROMPTS,
        reward_len_mod_2,
        num_iterations=5,
        output_dir=tmp_path / "run",
        overrides=_overrides(),
    )
    rows = _rows(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # step 1's delivery ran behind step 2's training: its figures are on step 2's line
    assert "sync/total_s" not in rows[0]
    assert all(r["sync/failed_engines"] == 0.0 for r in rows[1:])
    assert all(r["sync/write_s"] > 0.0 for r in rows[1:])  # the files' write, timed apart
    # every version reached the engines in time: nothing lagged more than the async bound (1)
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows), rows
    assert all(r["rollout/stale_groups_dropped"] == 0.0 for r in rows)
    # surplus groups kept from the batch before would be too stale by the time their batch
    # trains: the manager drops them up front, so every step trains a full batch of groups
    assert sum(r["rollout/surplus_groups_saved"] for r in rows) > 0
    assert all(r["rollout/groups_kept"] == 2.0 for r in rows), rows
    assert result.metrics["policy/version"] == 5.0
    # weight_sync.in_flight = "wait" (the default): a load waits for the requests in flight
    assert pauses and set(pauses) == {"wait"}, pauses


def test_a_failed_background_delivery_stops_the_run_after_a_rescue_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_sync = EnginePool.sync

    async def sync(pool: EnginePool, delivery: Delivery) -> SyncReport:
        version = delivery.weights.version
        if version == "2":  # the engines refuse step 2's weights
            failed = EngineSyncResult(url=pool.url, ok=False, attempts=1, error="injected")
            path = str(delivery.weights.path)
            raise WeightSyncError(
                SyncReport(version=version, path=path, results=(failed,), total_s=0.0)
            )
        return await real_sync(pool, delivery)

    monkeypatch.setattr(EnginePool, "sync", sync)
    with pytest.raises(BaseException) as info:
        quick_start_training(
            tiny_model_dir,
            PROMPTS,
            reward_len_mod_2,
            num_iterations=5,
            output_dir=tmp_path / "run",
            overrides=_overrides(checkpoint={"every": 1}),
        )
    errors = _leaves(info.value)
    failed = [e for e in errors if isinstance(e, WeightSyncError) and "injected" in str(e)]
    assert failed, errors
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "rl").glob("step_*"))
    # step 3 trained, then collected the failed delivery before its own periodic checkpoint: it
    # is saved by the rescue checkpoint instead (its metrics line comes back on --resume)
    assert steps[-2:] == ["step_000002", "step_000003"]
    assert "step 3 (the last trained one) was checkpointed" in "".join(failed[0].__notes__)
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]
    # the line --resume writes for step 3 comes from this checkpoint: it has the step's version
    extra = tmp_path / "run" / "checkpoints" / "rl" / "step_000003" / "extra_state.json"
    saved = json.loads(extra.read_text())["metrics"]
    assert saved["policy/version"] == 3.0, sorted(saved)


def test_the_background_write_holds_the_published_steps_weights(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files of version k are written beside step k+1, whose optimizer step changes the
    model meanwhile: they must still be step k's weights (its checkpoint's), not a mix.
    In this process (trainer_process = 'off'), where the write can be slowed down; the trainer
    process's snapshots: test_trainer_process.py."""
    written: dict[str, dict[str, torch.Tensor]] = {}
    real_write = PyTorchBackend.write_weights

    def slow_write(self: Any, weights: Mapping[str, torch.Tensor], path: Path) -> None:
        time.sleep(1.0)  # step k+1 trains (and steps the optimizer) meanwhile
        real_write(self, weights, path)
        written[Path(path).name] = load_hf_weights(Path(path))

    monkeypatch.setattr(PyTorchBackend, "write_weights", slow_write)
    result = quick_start_training(
        tiny_model_dir,
        PROMPTS,
        reward_last_token_parity,
        num_iterations=4,
        output_dir=tmp_path / "run",
        overrides=_overrides(
            checkpoint={"every": 1, "keep_last": 4},
            optim={"lr": 1e-2},
            training={"trainer_process": "off"},
        ),
    )
    rows = _rows(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sorted(written) == [f".tmp-v_{k}" for k in (1, 2, 3, 4)]
    checkpoints = tmp_path / "run" / "checkpoints" / "rl"
    for k in (1, 2, 3, 4):
        saved = load_hf_weights(checkpoints / f"step_{k:06d}" / "model")
        files = written[f".tmp-v_{k}"]
        assert saved.keys() <= files.keys() or files.keys() <= saved.keys()
        for name in saved.keys() & files.keys():
            assert torch.equal(files[name], saved[name]), (k, name)
    # and the updates did move the weights between versions (the comparison can fail)
    assert any(
        not torch.equal(written[".tmp-v_1"][n], written[".tmp-v_4"][n]) for n in written[".tmp-v_1"]
    )


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def test_async_lora_engines_load_the_adapter_while_the_next_step_trains(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """weight_sync.lora = "adapter" in async mode: the adapter is written when the step ends and
    loaded behind the next step (an OverlappedPublisher around the AdapterPublisher), checked
    by content each time."""
    result = quick_start_training(
        tiny_model_dir,
        PROMPTS,
        reward_last_token_parity,
        num_iterations=4,
        output_dir=tmp_path / "run",
        overrides=_overrides(model={"lora": {"enabled": True, "rank": 4, "alpha": 16.0}}),
    )
    rows = _rows(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "sync/total_s" not in rows[0]  # step 1's delivery is reported on step 2's line
    for row in rows[1:]:
        assert row["sync/failed_engines"] == 0.0, row
        assert row["sync/content_gap_max"] < 1e-4, row
        assert 0 < row["sync/bytes"] < 100_000, row  # the rank-4 adapter, not the model
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows), rows
    assert result.metrics["policy/version"] == 4.0
