"""Fixtures of the training tests: one finished tiny train.py run, shared by the tests that read
it (test_train_e2e) or damage a copy of it (test_resume_verify)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
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


def _build_run(root: Path) -> subprocess.CompletedProcess:
    from tests.training.test_train_e2e import _config, _train

    config = _config(root, logging={"trace": True})  # RUN/trace.json: tests/training/test_trace.py
    done = _train("--mode", "sft+rl", "--config", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _shared_run(root: Path) -> subprocess.CompletedProcess:
    """The run in `root`, built by the first xdist worker that asks (the others wait on the
    lock, then read its console from console.json): a session fixture is built once per worker,
    and test_train_e2e and test_resume_verify may land in different ones."""
    root.mkdir(parents=True, exist_ok=True)
    console = root / "console.json"
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not console.is_file():
            done = _build_run(root)
            record = {"args": done.args, "stdout": done.stdout, "stderr": done.stderr}
            console.write_text(json.dumps(record))
    record = json.loads(console.read_text())
    return subprocess.CompletedProcess(record["args"], 0, record["stdout"], record["stderr"])


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """Built once per session (about 25 s alone, 40-75 s on a loaded 2-core box); tests that
    change it work on a copy. Under xdist it lives beside the workers' temporary directories
    (their common parent, unique to the session): a worker's own is removed when it ends, while
    another worker may still read the run."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.mktemp("finished-run")
        done = _build_run(root)
    else:
        root = tmp_path_factory.getbasetemp().parent / "finished-run"
        done = _shared_run(root)
    return FinishedRun(root=root, config=root / "config.toml", run=root / "run", done=done)
