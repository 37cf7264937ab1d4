"""train.py's errors as a user sees them: the message alone, the traceback in the run's log.

Real runs of train.py with a bad dataset line, a reward function that cannot be imported, and a
reward function that always raises.
"""

from __future__ import annotations

from pathlib import Path

from tests.training.test_train_e2e import _config, _train


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


def test_a_bad_dataset_line_is_one_message(tmp_path: Path) -> None:
    bad = str(tmp_path / "data" / "bad.jsonl")
    config = _rl_config(
        tmp_path, data={"prepare": "", "train_path": bad, "sft_path": "", "eval_path": ""}
    )
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert_message_alone(done.stderr, "bad.jsonl:2", tmp_path / "run")
    debug = _train("--mode", "rl", "--config", str(config), "--debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "bad.jsonl:2" in debug.stderr


def test_a_reward_fn_that_cannot_be_imported_is_one_message(tmp_path: Path) -> None:
    config = _config(tmp_path, rollout={"reward_fn": "no_such_module.reward"})
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert_message_alone(done.stderr, "cannot import module 'no_such_module'", tmp_path / "run")


def test_a_reward_fn_that_always_raises_is_one_message(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        data={"eval_size": 2},  # the held-out eval before RL scores with it first
        rollout={"reward_fn": "tests.training.test_quick_start.always_raises"},
        training={"rl_steps": 4},
    )
    done = _train("--mode", "rl", "--config", str(config), timeout_s=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert_message_alone(done.stderr, "test_quick_start.always_raises raised", tmp_path / "run")
