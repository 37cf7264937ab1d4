"""Async mode: the engines load step k's weights while step k+1 trains (the delivery overlaps
the next step), every batch stays within the staleness bound and trains its full batch_size of
groups, and a delivery that fails stops the run in the next step, before that step's
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import rollouts.training.run as run_module
from rollouts.training.quick_start import quick_start_training
from rollouts.training.weight_sync import EngineSyncResult, SyncReport, WeightSyncError
from rollouts.types import Sample

PROMPTS = [f"{a}+{a}=" for a in range(10, 30)]


def reward_len_mod_2(sample: Sample) -> float:
    return float(sample.response_length % 2)


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
    tiny_model_dir: Path, tmp_path: Path
) -> None:
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
    # every version reached the engines in time: nothing lagged more than the async bound (1)
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows), rows
    assert all(r["rollout/stale_groups_dropped"] == 0.0 for r in rows)
    # surplus groups kept from the batch before would be too stale by the time their batch
    # trains: the manager drops them up front, so every step trains a full batch of groups
    assert sum(r["rollout/surplus_groups_saved"] for r in rows) > 0
    assert all(r["rollout/groups_kept"] == 2.0 for r in rows), rows
    assert result.metrics["policy/version"] == 5.0


def test_a_failed_background_delivery_stops_the_run_before_the_next_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_sync_pool = run_module.sync_pool

    async def sync_pool(pool: Any, path: Any, version: str, **kwargs: Any) -> SyncReport:
        if version == "2":  # the engines refuse step 2's weights
            failed = EngineSyncResult(url=pool.url, ok=False, attempts=1, error="injected")
            raise WeightSyncError(
                SyncReport(version=version, path=str(path), results=(failed,), total_s=0.0)
            )
        return await real_sync_pool(pool, path, version, **kwargs)

    monkeypatch.setattr(run_module, "sync_pool", sync_pool)
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
    assert any(isinstance(e, WeightSyncError) and "injected" in str(e) for e in errors), errors
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "rl").glob("step_*"))
    assert steps[-1] == "step_000002"  # published before the delivery failed; step 3 never is
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
