"""Runs that repeat (issue 27, item 7), with train.py, real engines and real processes.

Two sync-mode runs with the same `run.seed` log the same metrics and end on the same weights
(the second with its engine asleep while it trains):
every request carries a sampling seed derived from the run seed, the batch and the sample. The
one figure that is not bit-equal is the engine's logprob of a sampled token: the built-in engine
batches requests as they arrive, and a row's floats depend (by ~1e-9) on its batch. (A resumed
async run: test_train_kill_resume.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.training.test_train_e2e import _config, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

REWARD = {"reward_fn": "tests.training.varied_reward.varied_reward"}  # nonzero advantages
TIMING = ("time/", "perf/")
# the engine's logprobs of the sampled tokens: equal tokens, floats of another batch shape
BATCH_FLOATS = {"train/logprob_mismatch": 1e-6}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _comparable(row: dict) -> dict:
    """A metrics line without its timings (seconds, rates) and the engines' load."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(TIMING) and not re.search(r"_s(_|$)", k) and k != "engines/load"
    }


def _weights(run: Path, step: int) -> dict:
    return load_file(
        run / "checkpoints" / "rl" / f"step_{step:06d}" / "model" / "model.safetensors"
    )


def test_two_sync_runs_with_the_same_seed_log_the_same_metrics(tmp_path: Path) -> None:
    """Run b also puts its engine to sleep while it trains (`engines.sleep_level = 2`: the
    weights are discarded and come back by each step's sync): nothing it logs may differ."""
    runs = []
    for name, sleep_level in (("a", 0), ("b", 2)):
        work = tmp_path / name
        work.mkdir()
        config = _config(
            work,
            data={"eval_size": 2},
            training={"rl_steps": 3},
            rollout={"mode": "sync"} | REWARD,
            engines={"sleep_level": sleep_level},
        )
        done = _train("--mode", "rl", "--config", str(config))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs.append(work / "run")
    a, b = (_rows(run) for run in runs)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    assert any(r.get("train/grad_norm", 0.0) > 0.0 for r in a), a  # the steps did train
    assert all("time/sleep_s" in r and "time/wake_s" in r for r in b[1:]), b
    assert not any("time/sleep_s" in r for r in a), a
    assert all(r["sync/write_s"] > 0.0 for r in a[1:]), a  # the files' write, timed apart
    for ra, rb in zip(a, b, strict=True):
        ra, rb = _comparable(ra), _comparable(rb)
        assert ra.keys() == rb.keys()
        for key, tolerance in BATCH_FLOATS.items():
            if key in ra:
                assert ra.pop(key) == pytest.approx(rb.pop(key), abs=tolerance), key
        assert ra == rb
    wa, wb = _weights(runs[0], 3), _weights(runs[1], 3)
    assert all(wa[name].equal(wb[name]) for name in wa)  # bit-equal final weights
