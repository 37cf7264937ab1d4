"""Fixtures of the training tests: one finished tiny train.py run, shared by the tests that read
it (test_train_e2e) or damage a copy of it (test_resume_verify)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FinishedRun:
    """`train.py --mode sft+rl` run to the end on the tiny model (6 SFT steps, 3 RL steps,
    a checkpoint every step, the last 2 kept): its directories and its console."""

    root: Path  # config.toml, base/ (the tiny model), data/
    config: Path
    run: Path  # run.output_dir: metrics.jsonl, rollouts.jsonl, checkpoints/{sft,rl}/
    done: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """Built once per session (about 25 s); tests that change it work on a copy."""
    from tests.training.test_train_e2e import _config, _train

    root = tmp_path_factory.mktemp("finished-run")
    config = _config(root)
    done = _train("--mode", "sft+rl", "--config", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return FinishedRun(root=root, config=config, run=root / "run", done=done)
