"""One run per directory (issue 27 items 8 and 12), with real processes and real pids.

A real train.py run A holds its run directory; a second run on it fails at once naming A's pid
(run.overwrite = true, false, and --resume) and leaves A's files alone, without importing torch
(issue 45: the locks come before the heavy imports). Once A is SIGKILLed its
lock is taken over. Weight copies (/dev/shm) whose run is dead are removed by a new run; a live
run's and unknown ones are kept. Resuming on a full disk names the path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollouts.config import load_config
from rollouts.data.loaders import write_jsonl
from rollouts.driver.cli import main
from rollouts.driver.lock import (
    LOCK_NAME,
    RunInUse,
    acquire,
    hold_run_locks,
    read_owner,
)
from rollouts.driver.metrics import JsonlSink
from rollouts.driver.orphans import remove_orphaned_weight_copies
from rollouts.driver.setup import prepare_run_dir
from rollouts.trainer.disk_errors import DiskWriteError
from tests.training.test_files_reliability import fill, small_disk  # noqa: F401
from tests.training.test_train_e2e import TRAIN

ROOT = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
]


def _sft_config(tmp: Path, model: Path, name: str, **run: object) -> Path:
    write_jsonl(tmp / "sft.jsonl", [{"messages": c} for c in CHATS])
    table = {
        "run": {"output_dir": str(tmp / "run"), "name": "lock-test", **run},
        "model": {"path": str(model)},
        "data": {"sft_path": str(tmp / "sft.jsonl"), "sft_eval_fraction": 0.0},
        "training": {"sft_steps": 1, "sft_batch_size": 2, "torch_threads": 1},
        "checkpoint": {"every": 1},
        "logging": {"progress_bar": False},
    }
    path = tmp / name
    path.write_text(
        "".join(
            f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
            for section, keys in table.items()
        )
    )
    return path


@pytest.fixture
def run_a(tmp_path: Path, tiny_model_dir: Path) -> Iterator[subprocess.Popen]:
    """A real train.py SFT run that goes on until killed, with a checkpoint on disk."""
    config = _sft_config(tmp_path, tiny_model_dir, "a.toml")
    text = config.read_text().replace("sft_steps = 1", "sft_steps = 1000000")
    config.write_text(text.replace("every = 1", "every = 20"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    a = subprocess.Popen(
        [sys.executable, str(TRAIN), "--mode", "sft", "--config", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints = tmp_path / "run" / "checkpoints" / "sft"
    deadline = time.monotonic() + 60
    while not any(checkpoints.glob("step_*")):
        assert a.poll() is None, a.stderr.read() if a.stderr else ""
        assert time.monotonic() < deadline, "run A wrote no checkpoint in 60 s"
        time.sleep(0.1)
    try:
        yield a
    finally:
        if a.poll() is None:
            a.kill()
        a.wait()


def test_a_second_run_on_a_live_runs_directory_fails_at_once_naming_its_pid(
    tmp_path: Path,
    tiny_model_dir: Path,
    run_a: subprocess.Popen,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    assert read_owner(run / LOCK_NAME) is not None
    assert read_owner(run / LOCK_NAME).pid == run_a.pid  # type: ignore[union-attr]
    before = (run / "config.json").read_text()
    for name, args, overwrite in [
        ("b1.toml", [], True),  # was: B deleted A's directory mid-run, both exited 0
        ("b2.toml", [], False),
        ("b3.toml", ["--resume"], False),  # was: both wrote checkpoints into one directory
    ]:
        config = _sft_config(tmp_path, tiny_model_dir, name, overwrite=overwrite)
        started = time.monotonic()
        assert main(["--mode", "sft", "--config", str(config), *args]) == 1
        assert time.monotonic() - started < 5.0  # at once: before data, model or engines
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {run_a.pid}, started " in err, err
        assert "run.output_dir" in err and "Traceback" not in err, err
    assert run_a.poll() is None  # A goes on, its files untouched
    assert (run / "config.json").read_text() == before
    assert not (run / "error.log").exists()  # B's error is not written into A's directory
    assert any((run / "checkpoints" / "sft").glob("step_*"))

    run_a.send_signal(signal.SIGKILL)  # a dead run: its lock is stale
    run_a.wait()
    config = load_config(str(_sft_config(tmp_path, tiny_model_dir, "b4.toml")))
    with hold_run_locks(config, bases=[]):
        assert read_owner(run / LOCK_NAME).pid == os.getpid()  # type: ignore[union-attr]
    out = capsys.readouterr().out
    assert f"taking over the lock of pid {run_a.pid}, which is no longer running" in out, out
    assert not (run / LOCK_NAME).exists()  # released at the end of the run


def test_overwrite_empties_the_directory_but_keeps_the_lock(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = load_config(str(_sft_config(tmp_path, tiny_model_dir, "c.toml", overwrite=True)))
    run = tmp_path / "run"
    (run / "checkpoints" / "sft" / "step_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with hold_run_locks(config, bases=[]):
        prepare_run_dir(config, "c.toml", resume=False)
        assert sorted(p.name for p in run.iterdir()) == ["config.json", LOCK_NAME]
        with pytest.raises(RunInUse, match=rf"in use by another run \(pid {os.getpid()}"):
            acquire(run / LOCK_NAME, "run.output_dir", "choose another")


LOCK_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rollouts.driver.lock import acquire
    base = Path(sys.argv[1])
    (base / ("rollouts-" + sys.argv[2]) / "v_1").mkdir(parents=True)
    acquire(base / ("rollouts-" + sys.argv[2] + ".lock"), "copies", "")
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def _holder(base: Path, name: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(base), name],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def test_a_new_run_removes_the_weight_copies_of_dead_runs_only(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    dead, live = _holder(base, "dead"), _holder(base, "live")
    try:
        dead.send_signal(signal.SIGKILL)  # killed mid-run: its copies stay behind
        dead.wait()
        (base / "rollouts-unknown" / "v_3").mkdir(parents=True)  # no lock: not ours to judge
        assert read_owner(base / "rollouts-dead.lock").pid == dead.pid  # type: ignore[union-attr]
        config = load_config(str(_sft_config(tmp_path, tiny_model_dir, "d.toml")))
        with hold_run_locks(config, bases=[base]):  # a new run, in another directory
            pass
        assert sorted(p.name for p in base.iterdir()) == [
            "rollouts-live",
            "rollouts-live.lock",
            "rollouts-unknown",
        ]
        out = capsys.readouterr().out
        assert f"removed the weight copies of a run that died: {base}/rollouts-dead" in out
        assert remove_orphaned_weight_copies([base]) == []  # the live one stays
    finally:
        live.kill()
        live.wait()
    assert remove_orphaned_weight_copies([base]) == [base / "rollouts-live"]


def test_resuming_on_a_full_disk_names_the_path(
    tmp_path: Path,
    tiny_model_dir: Path,
    small_disk: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _sft_config(tmp_path, tiny_model_dir, "e.toml")
    config.write_text(config.read_text().replace(str(tmp_path / "run"), str(small_disk / "run")))
    (small_disk / "run" / "checkpoints" / "sft").mkdir(parents=True)
    metrics = small_disk / "run" / "sft_metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "sft/loss": 1.0}) + "\n")
    fill(small_disk)
    assert main(["--mode", "sft", "--config", str(config), "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"{small_disk}/run/" in err and "the disk is full" in err, err  # was: [Errno 28]
    with pytest.raises(DiskWriteError, match=rf"{small_disk}/run/sft_metrics.tmp: the disk is"):
        JsonlSink(metrics, resume_step=1)


REFUSED_BARE = textwrap.dedent(
    """
    import json, runpy, sys
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        heavy = [m for m in ("torch", "transformers", "rollouts.driver.run") if m in sys.modules]
        print(json.dumps({"rc": e.code, "heavy": heavy}))
    """
)


def test_a_second_run_is_refused_before_torch_is_imported(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.py reads the config, takes the locks, and only then imports the training: a run
    on a live run's directory is refused without importing torch (was: ~7 s of imports first),
    also when it would re-launch itself under torchrun (--nproc 2)."""
    monkeypatch.setenv("ROLLOUTS_WEIGHT_COPIES", str(tmp_path))  # no /dev/shm lock of ours
    config = _sft_config(tmp_path, tiny_model_dir, "f.toml")
    with hold_run_locks(load_config(str(config)), bases=[]):  # the live run: this process
        for extra in ([], ["--nproc", "2"]):
            args = ["--mode", "sft", "--config", str(config), *extra]
            refused = subprocess.run(
                [sys.executable, "-c", REFUSED_BARE, str(TRAIN), *args],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            report = json.loads(refused.stdout.splitlines()[-1])
            assert report == {"rc": 1, "heavy": []}, (extra, report, refused.stderr)
            assert f"is in use by another run (pid {os.getpid()}, " in refused.stderr
            assert "re-launching under torchrun" not in refused.stdout, refused.stdout
