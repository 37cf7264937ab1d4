"""train.py's errors as a user sees them: the message alone, the traceback in the run's log.

train.py's `main` (in this process; the engines are real processes) with a bad dataset line, a
reward function that cannot be imported, and a reward function that always raises.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.driver.cli import main
from tests.training.test_train_e2e import _config


def _rl_config(tmp: Path, **sections: dict) -> Path:
    rows = '{"prompt": "1+1=", "label": "2"}\n{"prompt": 3, "label": "4"}\n'
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    (tmp / "data" / "bad.jsonl").write_text(rows)
    return _config(tmp, **sections)


def assert_message_alone(stderr: str, expected: str, run: Path) -> None:
    assert "error: " in stderr and expected in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    error_at = stderr.index("error: ")
    assert len(stderr[error_at:].strip().splitlines()) == 2, stderr[-3000:]  # message, log path
    log = (run / "error.log").read_text()
    assert "Traceback" in log and expected in log


def test_a_bad_dataset_line_is_one_message(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = str(tmp_path / "data" / "bad.jsonl")
    config = _rl_config(
        tmp_path,
        model={"path": str(tiny_model_dir)},
        model__tiny={"enabled": False},  # a model already there, not one to build
        data={"prepare": "", "train_path": bad, "sft_path": "", "eval_path": ""},
    )
    assert main(["--mode", "rl", "--config", str(config)]) == 1
    assert_message_alone(capsys.readouterr().err, "bad.jsonl:2", tmp_path / "run")
    assert main(["--mode", "rl", "--config", str(config), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "bad.jsonl:2" in err


def test_a_reward_fn_that_cannot_be_imported_is_one_message(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(
        tmp_path,
        model={"path": str(tiny_model_dir)},
        model__tiny={"enabled": False},  # a model already there, not one to build
        rollout={"reward_fn": "no_such_module.reward"},
    )
    assert main(["--mode", "rl", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert_message_alone(err, "cannot import module 'no_such_module'", tmp_path / "run")


def test_a_reward_fn_that_always_raises_is_one_message(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(
        tmp_path,
        model={"path": str(tiny_model_dir)},
        model__tiny={"enabled": False},  # a model already there, not one to build
        data={"eval_size": 2},  # the held-out eval before RL scores with it first
        rollout={"reward_fn": "tests.training.test_quick_start.always_raises"},
        training={"rl_steps": 4},
    )
    assert main(["--mode", "rl", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert_message_alone(err, "test_quick_start.always_raises raised", tmp_path / "run")


def test_disk_sync_to_a_remote_engine_through_dev_shm_stops_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.py refuses before any work (no data, no model, no wait for the engine)."""
    remote = "http://203.0.113.7:30000"  # TEST-NET-3: never this host
    config = _config(tmp_path, engines={"kind": "sglang", "urls": [remote]})
    assert main(["--mode", "rl", "--config", str(config)]) == 1
    stderr = capsys.readouterr().err
    assert_message_alone(stderr, f"but engine {remote} is on another host", tmp_path / "run")
    assert "set weight_sync.dir" in stderr
    assert not (tmp_path / "base").exists()  # stopped before the model was built
