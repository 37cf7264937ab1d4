"""The engines die for good mid-run (a real SIGKILL, no restarts left): the run stops at once with
the engine error (no step that trained nothing is logged: a step is an update), but first
checkpoints the last step it trained, so the steps since the last periodic checkpoint are not
lost, and the prompts of the lost batch go back; --resume continues from there, logs every step
exactly once, and trains every prompt in order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import programs
from tests.training.test_engine_failover import server_pids, wait_gone
from tests.training.test_train_e2e import ROOT, _config, _expected_order, _order, _steps, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

TRAIN = ROOT / "integration_training" / "train.py"


def _run_until_killed(config: Path, run: Path, marker: str, log: Path) -> tuple[int, float]:
    """train.py until step 2 is logged, then SIGKILL its only engine; its exit code and the
    seconds from the kill to its exit."""
    with log.open("w") as out:
        train = programs.popen(
            [sys.executable, str(TRAIN), "--mode", "rl", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 240
            metrics = run / "metrics.jsonl"
            while time.monotonic() < deadline and train.poll() is None:
                if metrics.exists() and 2 in _steps(metrics):
                    break
                time.sleep(0.02)
            engines = server_pids(marker)
            assert len(engines) == 1, (engines, log.read_text()[-3000:])
            os.kill(engines[0], signal.SIGKILL)
            killed = time.monotonic()
            return train.wait(timeout=240), time.monotonic() - killed
        finally:
            if train.poll() is None:
                train.kill()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_last_trained_step_is_checkpointed_when_the_engines_die(
    tmp_path: Path, mode: str
) -> None:
    config = _config(
        tmp_path,
        data={"eval_size": 2},
        training={"rl_steps": 12},
        rollout={"mode": mode},
        # no restart left: nothing to wait for (the 120 s would show in the time to stop)
        engines={"wait_for_up_s": 120.0, "health_interval_s": 0.5},
        engines__builtin={"max_restarts": 0},
        checkpoint={"every": 0},  # no periodic checkpoint: only the end (and the rescue)
    )
    run, marker, log = tmp_path / "run", str(tmp_path / "base"), tmp_path / "train.log"
    code, stopping_s = _run_until_killed(config, run, marker, log)
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert stopping_s < 60.0, (stopping_s, text[-3000:])  # at once: not after wait_for_up_s
    # the engine's error, at once (a batch's, or in async mode maybe the weight sync's): not
    # after batches that trained nothing
    lost = "error: no healthy engine could generate" in text
    assert lost or (mode == "async" and "error: weight sync to version" in text), text[-3000:]
    assert "went back to the buffer" in text or not lost, text[-3000:]
    assert "trained nothing" not in text and "in a row" not in text, text[-3000:]
    logged = _steps(run / "metrics.jsonl")
    last = logged[-1]
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= last < 12 and logged == list(range(last + 1)), (logged, text[-3000:])
    assert all(row["policy/version"] == row["step"] for row in before[1:]), before  # updates
    saved = sorted(p.name for p in (run / "checkpoints" / "rl").glob("step_*"))
    assert len(saved) == 1, saved
    rescued = int(saved[0].removeprefix("step_"))
    # the step that trained last: logged, or trained and then stopped at its weight sync
    assert rescued in (last, last + 1), (saved, logged)
    # its weights are the last trained ones: the version after step `last`, plus one when the
    # run stopped at step last + 1's weight sync (trained, not yet logged)
    version = json.loads((run / "checkpoints" / "rl" / saved[0] / "manifest.json").read_text())
    trained_after_last = int(before[last]["policy/version"]) + (rescued - last)
    assert int(version["weight_version"]) == trained_after_last, (version, before[last])
    assert f"step {rescued} (the last trained one) was checkpointed" in text, text[-3000:]
    assert wait_gone(marker) == []

    done = _train("--mode", "rl", "--config", str(config), "--resume", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _steps(run / "metrics.jsonl") == list(range(13))  # every step once, none lost
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[: last + 1] == before  # the lines before the kill, kept as they were
    assert rows[rescued + 1]["policy/version"] == trained_after_last + 1  # trained on from it
    assert all(row["policy/version"] == row["step"] for row in rows[1:]), rows  # 12 updates
    order = _order(run / "rollouts.jsonl")  # no prompt lost with the failed batch
    assert [order[s] for s in range(1, 13)] == _expected_order(tmp_path, 12, 2)
    assert server_pids(marker) == []
