"""The adaptive KL controller in a real run: applied, updated as verl's, and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training.test_train_e2e import _config, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py


def _rows(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if row["step"] > 0}


def _next_coef(row: dict, target: float, horizon: int, n_seqs: int) -> float:
    err = min(max(row["train/reward_kl_seq_mean"] / target - 1.0, -0.2), 0.2)
    return row["train/kl_coef"] * (1.0 + err * n_seqs / horizon)


def test_adaptive_kl_coefficient_moves_and_survives_resume(tmp_path: Path) -> None:
    target, horizon, n_seqs = 0.001, 4, 4  # batch 2 groups x 2 samples
    kl = {"coef": 0.1, "into": "reward", "target": target, "horizon": horizon}
    config = _config(
        tmp_path,
        training={"rl_steps": 2},
        algorithm__kl=kl,
        algorithm__reference={"update": "none"},
    )
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    rows = _rows(run)
    assert rows[1]["train/kl_coef"] == pytest.approx(0.1)
    # step 1: policy == reference, KL 0 -> error clipped to -0.2 -> coef * (1 - 0.2 * 4 / 4)
    assert rows[1]["train/reward_kl_seq_mean"] == pytest.approx(0.0, abs=1e-7)
    assert rows[2]["train/kl_coef"] == pytest.approx(0.08)
    resumed = _train(
        "--mode", "rl", "--config", str(config), "--resume", "--set", "training.rl_steps=3"
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = _rows(run)
    assert sorted(rows) == [1, 2, 3]
    # the resumed step 3 continues from the controller after step 2, not from kl_coef = 0.1
    assert rows[3]["train/kl_coef"] == pytest.approx(_next_coef(rows[2], target, horizon, n_seqs))
    assert rows[3]["train/kl_coef"] != pytest.approx(0.1)
