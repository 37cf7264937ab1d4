"""A LoRA RL run with train.py and the built-in engine, as a user runs it (real processes): only
the adapter goes to the engine (bytes per sync), the content check passes after every sync, the
reference is the base model, and a run SIGKILLed mid-way resumes to the very same adapter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests import programs
from tests.training.test_train_e2e import ROOT, TRAIN, _config, _order, _steps, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

LORA = {
    "model__lora": {"enabled": True, "rank": 4, "alpha": 16.0},
    "algorithm__kl": {"coef": 0.05},
    "optim": {"lr": 3e-3, "scheduler": "constant"},
    "data": {"eval_size": 2},
    "training": {"rl_steps": 4},
    "rollout": {"reward_fn": "tests.training.varied_reward.varied_reward"},
}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run: Path, step: int) -> dict:
    path = run / "checkpoints" / "rl" / f"step_{step:06d}" / "adapter"
    return load_file(path / "adapter_model.safetensors")


def _kill_after(config: Path, run: Path, lines: int) -> None:
    """train.py started, SIGKILLed (with its engines) once metrics.jsonl has `lines` lines."""
    cmd = [sys.executable, str(TRAIN), "--mode", "rl", "--config", str(config)]
    proc = programs.popen(
        cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(_steps(metrics)) >= lines:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_lora_rl_syncs_the_adapter_alone_and_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    done = _train("--mode", "rl", "--config", str(_config(straight, **LORA)), timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reference model: the base model (the LoRA adapters off)" in done.stdout
    run = straight / "run"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    full_bytes = (straight / "base" / "model.safetensors").stat().st_size
    adapter_file = run / "checkpoints" / "rl" / "step_000004" / "adapter"
    adapter_bytes = (adapter_file / "adapter_model.safetensors").stat().st_size
    for row in rows[1:]:
        assert row["sync/failed_engines"] == 0.0, row
        assert row["sync/content_gap_max"] < 1e-4, row  # checked after every sync
        assert row["sync/bytes"] < full_bytes / 3, (row["sync/bytes"], full_bytes)
        assert row["sync/bytes"] >= adapter_bytes  # the adapter's files, nothing more
        assert row["sync/write_s"] > 0.0, row
    assert any(r["train/kl"] > 0 for r in rows[1:])  # the policy left its reference, the base
    assert not (run / "checkpoints" / "rl" / "step_000004" / "model").exists()

    killed = tmp_path / "killed"
    killed.mkdir()
    config = _config(killed, **LORA)
    _kill_after(config, killed / "run", lines=3)  # the eval line and two steps
    resumed = _train("--mode", "rl", "--config", str(config), "--resume", timeout_s=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _steps(killed / "run" / "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert _order(killed / "run" / "rollouts.jsonl") == _order(run / "rollouts.jsonl")
    a, b = _adapter(run, 4), _adapter(killed / "run", 4)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), "the resumed run ends on another adapter"


def test_lora_rl_under_fsdp_syncs_the_adapter_alone(tmp_path: Path) -> None:
    """The same run on 2 torchrun ranks (FSDP2): rank 0 gathers the adapter and publishes it."""
    fsdp = LORA | {"training": {"rl_steps": 2, "backend": "fsdp", "nproc": 2}}
    done = _train("--mode", "rl", "--config", str(_config(tmp_path, **fsdp)), timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reference model: the base model (the LoRA adapters off)" in done.stdout
    run = tmp_path / "run"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    full_bytes = (tmp_path / "base" / "model.safetensors").stat().st_size
    for row in rows[1:]:
        assert row["sync/failed_engines"] == 0.0, row
        assert row["sync/content_gap_max"] < 1e-4, row
        assert row["sync/bytes"] < full_bytes / 3, (row["sync/bytes"], full_bytes)
    assert rows[-1]["train/kl"] > 0  # the policy left its reference, the base
    step = run / "checkpoints" / "rl" / "step_000002"
    assert (step / "adapter" / "adapter_model.safetensors").is_file()
    assert (step / "optimizer").is_dir()  # the adapters' AdamW state, as DCP shards
