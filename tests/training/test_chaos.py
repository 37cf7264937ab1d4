"""The short chaos run (`scripts/chaos.py`): a 4-step sync run on the tests' tiny model broken by
five faults (SIGKILL of the driver mid-checkpoint, of an engine mid-sync and of the trainer
process, a corrupted checkpoint file, a full disk when a tmpfs can be mounted), resumed after
each as a user would, must end on the unbroken run's weights, metrics and prompts, with
metrics.jsonl whole and nothing left in /dev/shm or the process table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.training.test_train_e2e import ROOT, _config

KINDS = "kill_driver_mid_checkpoint,kill_engine_mid_sync,kill_trainer,corrupt_checkpoint,full_disk"


def test_a_short_chaos_run_ends_as_the_unbroken_one(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        data={"eval_size": 2},
        rollout={"reward_fn": "tests.training.varied_reward.varied_reward"},
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--config", str(config)]
    command += ["--sft-steps", "0", "--steps", "4", "--faults", "5", "--kinds", KINDS]
    command += ["--checkpoint-every", "1", "--tmpfs-mb", "32", "--out", str(tmp_path / "chaos")]
    command += ["--timeout-min", "8"]  # it stops (and cleans up) before the test's bound
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    report = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "FAIL" not in done.stdout, report
    assert "5 faults planned, 5 injected" in done.stdout, report  # none skipped
