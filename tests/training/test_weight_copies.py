"""Weight copies for the engines never outlive their owner (issue 45, part 2), real processes.

A run that fails before its loop (here: an engine URL nobody listens on) removes its own copy
before it exits. A copy directory with no lock at all, as older versions left them (and as a
failed start did), is removed by the next run once nothing in it changed for a while; a live
run's is kept, and so is one being written this instant. Every test points the copies' base at
its own temporary directory (`$ROLLOUTS_WEIGHT_COPIES`), so no other run's copies are touched.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from rollouts.config import load_config
from rollouts.driver.cli import main
from rollouts.driver.lock import hold_run_locks
from rollouts.driver.orphans import UNLOCKED_FRESH_S
from rollouts.weights.copies import BASE_ENV, run_sync_root
from tests.training.test_run_lock import _holder, _sft_config
from tests.training.test_train_e2e import _config

STALE = "rollouts-old-run-0123456789"  # a name run_sync_root gives: <run name>-<10 hex>


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _age(path: Path, seconds: float) -> None:
    """Everything under `path` (and `path`) modified `seconds` ago."""
    then = time.time() - seconds
    for top, dirs, files in os.walk(path, topdown=False):
        for name in [*(os.path.join(top, n) for n in dirs + files), top]:
            os.utime(name, (then, then))


def test_a_run_whose_engine_never_answers_leaves_no_weight_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: `rollouts-<run>-<hash>/v_0` stayed with no lock beside it (GBs for a real model)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(BASE_ENV, str(shm))
    url = f"http://127.0.0.1:{_closed_port()}"
    config = _config(
        tmp_path,
        run={"name": "unreachable"},
        engines={"kind": "sglang", "urls": [url], "startup_timeout_s": 1.0},
    )
    assert main(["--mode", "rl", "--config", str(config)]) == 1  # train.py's main, in-process
    out, err = capsys.readouterr()
    assert url in err, err[-3000:]  # it did fail at the engines' start
    root = run_sync_root("", "unreachable", tmp_path / "run")
    assert root.parent == shm, root
    assert f"weights go through {root}" in out, out[-3000:]
    assert sorted(p.name for p in shm.iterdir()) == []  # no copy, no lock file


def test_copies_without_a_lock_are_removed_once_stale_a_live_runs_kept(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv(BASE_ENV, str(base))
    stale = base / STALE / "v_3"  # an older version's copy of a run that died long ago
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"weights")
    _age(base / STALE, UNLOCKED_FRESH_S + 60)
    fresh = base / "rollouts-starting-abcdef0123" / ".tmp-v_0"  # being written this instant
    fresh.mkdir(parents=True)
    other = base / "rollouts-notes-0123456789"  # named alike, but not weight copies
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _age(other, UNLOCKED_FRESH_S + 60)
    live = _holder(base, "live-0123456789")  # a live run of this version, silent for long
    try:
        _age(base / "rollouts-live-0123456789", UNLOCKED_FRESH_S + 60)
        config = load_config(str(_sft_config(tmp_path, tiny_model_dir, "a.toml")))
        with hold_run_locks(config):  # a new run: its clean-up looks under $ROLLOUTS_WEIGHT_COPIES
            assert not (base / STALE).exists()  # was: kept for ever (no lock: never judged)
        assert sorted(p.name for p in base.iterdir()) == [
            "rollouts-live-0123456789",
            "rollouts-live-0123456789.lock",
            "rollouts-notes-0123456789",
            "rollouts-starting-abcdef0123",
        ]
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
