"""RL runs whose metrics must tell the truth (issue 17): sync mode trains nothing stale, a
short batch is in metrics.jsonl, and a run that filters everything says which filter did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollouts.driver.quick_start import quick_start_training
from rollouts.types import Sample

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py


def reward_len_mod_2(sample: Sample) -> float:
    return float(sample.response_length % 2)


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _sync_run_with_partial_rollouts(model_dir: Path, out: Path, **rollout: object) -> list[dict]:
    """Four sync steps that over-sample 2x with partial rollouts; the metrics rows."""
    result = quick_start_training(
        model_dir,
        [f"{a}+{a}=" for a in range(10, 30)],
        reward_len_mod_2,
        num_iterations=4,
        output_dir=out,
        overrides={
            "rollout": {
                "mode": "sync",
                "batch_size": 2,
                "n_samples_per_prompt": 2,
                "over_sampling_factor": 2.0,
                "partial_rollouts": True,
                # every 16th token id stops: varied lengths, so surplus groups get aborted
                "sampling": {"max_new_tokens": 24, "stop_token_ids": list(range(0, 300, 16))},
                **rollout,
            },
            "logging": {"console": False},
        },
    )
    return _rows(result.run_dir)


def test_sync_mode_with_partial_rollouts_trains_nothing_stale(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = _sync_run_with_partial_rollouts(tiny_model_dir, tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] == 0.0 for r in rows), rows
    assert all(r["rollout/stale_groups_dropped"] == 0.0 for r in rows)  # dropped before: none
    assert sum(r["rollout/stale_partial_groups"] for r in rows) > 0  # saved work was stale
    assert all("rollout/short_batch" in r for r in rows)
    # that stale work is generation thrown away (issue 27, item 2): counted where it is dropped
    for r in rows:
        assert (r["rollout/discarded_tokens"] > 0) == (r["rollout/stale_partial_groups"] > 0), r
        fraction = min(r["rollout/discarded_tokens"] / r["rollout/generated_tokens"], 1.0)
        assert r["rollout/discarded_fraction"] == pytest.approx(fraction), r


def test_sync_mode_with_a_staleness_bound_of_one_trains_the_saved_work_a_step_later(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # configs/smollm2-lora-cpu.toml's setting: the surplus and aborted groups of one batch are
    # trained in the next one (one version old) instead of being dropped as stale
    rows = _sync_run_with_partial_rollouts(tiny_model_dir, tmp_path / "run", max_staleness=1)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows), rows
    assert any(r["rollout/staleness_max"] == 1.0 for r in rows), rows  # saved work trained
    saved = sum(r["rollout/partial_groups_saved"] for r in rows)
    # only work saved twice (aborted, resumed, aborted again: two versions old) is dropped
    assert sum(r["rollout/stale_partial_groups"] for r in rows) < saved / 2, rows
    assert all(r["rollout/stale_groups_dropped"] == 0.0 for r in rows), rows


def test_a_run_whose_filter_drops_everything_names_the_filter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(BaseException) as info:
        quick_start_training(
            tiny_model_dir,
            ["1+1=", "2+2=", "3+3="],
            lambda s: 1.0,  # every group has zero reward std
            num_iterations=5,
            output_dir=tmp_path / "run",
            overrides={
                "rollout": {
                    "batch_size": 1,
                    "n_samples_per_prompt": 2,
                    "max_over_sampling_rounds": 1,
                    "filters": ["check_reward_nonzero_std"],
                    "sampling": {"max_new_tokens": 4},
                },
                "logging": {"console": False},
            },
        )
    messages = " ".join(str(e) for e in _leaves(info.value))
    assert "RL made no update in 3 batches in a row (after step 0)" in messages
    assert "groups dropped by the filters: {'zero_reward_std': " in messages
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or _rows(tmp_path / "run") == []  # no update: no step


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
