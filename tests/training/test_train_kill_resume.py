"""train.py SIGKILLed right after it published a checkpoint, then resumed: real processes.

The kill lands between `step_000002` becoming visible and its metrics line (the worst moment):
the engines it started die with it, its weight-sync copies are named by the run (so the resumed
run finds and removes them), and after --resume metrics.jsonl has every step exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollouts.weights.copies import run_sync_root
from tests import programs
from tests.training.test_engine_failover import server_pids, wait_gone
from tests.training.test_train_e2e import ROOT, _config, _steps, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

KILL_AFTER_PUBLISH = textwrap.dedent(
    """
    import os, signal, sys
    from rollouts.trainer import checkpoint

    publish = checkpoint._publish

    def publish_then_die(tmp, final, *args):  # the fault: SIGKILL once step 2 is published
        publish(tmp, final, *args)
        if final.name == "step_000002" and "rl" in str(final):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._publish = publish_then_die
    from rollouts.driver.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_kill_right_after_a_checkpoint_then_resume(tmp_path: Path) -> None:
    """In async mode: the checkpoint also keeps the batch made ahead (batch 3, made while step 2
    trained, on the older weights), and the resumed run trains that very batch first, as the
    uninterrupted run would have, not a new one made on the checkpoint's weights (issue 27,
    item 7)."""
    config = _config(
        tmp_path,
        data={"eval_size": 2},
        training={"rl_steps": 3},
        run={"name": f"killed-{os.getpid()}"},
        rollout={"mode": "async", "reward_fn": "tests.training.varied_reward.varied_reward"},
    )
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_PUBLISH, "--mode", "rl", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert _steps(run / "metrics.jsonl") == [0, 1]  # step 2 is checkpointed, its line is not
    assert (run / "checkpoints" / "rl" / "step_000002").is_dir()
    marker = str(tmp_path / "base")  # the engines' --model
    assert wait_gone(marker) == []  # the trainer's engines died with it
    shm = run_sync_root("", f"killed-{os.getpid()}", run)
    assert shm.is_dir()  # left by the kill, under a name the resumed run knows
    saved = run / "checkpoints" / "rl" / "step_000002" / "extra_state.json"
    ahead = json.loads(saved.read_text())["rl_loop"]["next_batch"]
    assert ahead["number"] == 3
    made = [s for group in ahead["groups"] for s in group]
    assert all(int(s["weight_versions"][0]) < 2 for s in made), made  # older than step 2's

    done = _train("--mode", "rl", "--config", str(config), "--resume", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]  # no missing step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "reward/mean" in rows[2] and "train/clipfrac" in rows[2], rows[2]
    logged = map(json.loads, (run / "rollouts.jsonl").read_text().splitlines())
    trained = [row for row in logged if row["step"] == 3]
    key = lambda s: (s["group_index"], s["index"], s["reward"], s["weight_versions"])  # noqa: E731
    assert sorted(map(key, trained)) == sorted(map(key, made))  # that batch, not a new one
    assert rows[3]["rollout/staleness_max"] >= 1.0  # older than the version it trained at
    assert not shm.exists()  # cleaned on exit
    assert server_pids(marker) == []


def test_an_engine_killed_mid_run_costs_no_step(tmp_path: Path) -> None:
    """One of two engines SIGKILLed during RL: the run re-routes, syncs the engine that is up,
    restarts the dead one, and logs and checkpoints every step."""
    config = _config(
        tmp_path,
        data={"eval_size": 2},
        # steps of ~0.15 s: enough of them after the kill for a health check (every 0.5 s) to
        # find the dead engine and restart it before the run ends
        training={"rl_steps": 12},
        engines={"health_interval_s": 0.5, "max_retries": 1},
        engines__builtin={"num_engines": 2},
    )
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    cmd = [sys.executable, str(ROOT / "integration_training" / "train.py"), "--mode", "rl"]
    with log.open("w") as out:
        train = programs.popen(
            [*cmd, "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and train.poll() is None:
                if (run / "metrics.jsonl").exists() and 1 in _steps(run / "metrics.jsonl"):
                    break
                time.sleep(0.1)
            engines = server_pids(str(tmp_path / "base"))
            assert len(engines) == 2, (engines, log.read_text()[-3000:])
            os.kill(engines[-1], signal.SIGKILL)
            assert train.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            if train.poll() is None:
                train.kill()
    text = log.read_text()
    assert _steps(run / "metrics.jsonl") == list(range(13)), text[-3000:]
    assert "restart 1/3" in text, text[-3000:]
    assert (run / "checkpoints" / "rl" / "step_000012").is_dir()
    assert wait_gone(str(tmp_path / "base")) == []
