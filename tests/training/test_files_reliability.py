"""Run files under faults: a full disk (a real small tmpfs) and a kill in the middle of a delete.

A metrics line is written whole or not at all; a torn last line (an older writer, a crash) is cut
on resume; a checkpoint that does not fit says which path and that the disk is full, and leaves
no temporary directory; a rotation killed half-way never leaves a half-deleted `step_*`.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollouts.driver.metrics import JsonlSink, read_jsonl_rows
from rollouts.trainer.checkpoint import list_checkpoints, save_checkpoint
from rollouts.trainer.disk_errors import DiskWriteError
from rollouts.trainer.factories import create_pytorch_backend
from tests.training.backend_helpers import one_torch_thread, tiny_config  # noqa: F401

PAGE = 4096
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root, as in CI's container; skipped where mounting is refused)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_pages: int = 0) -> list[Path]:
    """Fill `disk` with one-page files until it is full, then free `leave_pages` of them."""
    files: list[Path] = []
    while True:
        path = disk / f"filler-{len(files)}"
        try:
            path.write_bytes(b"\0" * PAGE)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            path.unlink(missing_ok=True)
            break
        files.append(path)
    for path in files[:leave_pages]:
        path.unlink()
    return files[leave_pages:]


def big_metrics() -> dict[str, float]:
    return {f"key/{i:05d}": float(i) for i in range(800)}  # ~14 KB: several pages


def test_a_full_disk_never_tears_a_metrics_line(small_disk: Path) -> None:
    path = small_disk / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"loss": 0.5})
    fillers = fill(small_disk, leave_pages=1)  # the line gets one page and a bit: a partial write
    with pytest.raises(DiskWriteError, match=rf"{path}: the disk is full"):
        sink.log(2, big_metrics())
    assert path.read_text().endswith("\n")
    assert [r["step"] for r in read_jsonl_rows(path)] == [1]
    for f in fillers:
        f.unlink()
    sink.log(2, big_metrics())  # space freed: the run goes on
    sink.close()
    assert [r["step"] for r in read_jsonl_rows(path)] == [1, 2]


def test_a_torn_last_line_from_a_full_disk_is_cut_on_resume(small_disk: Path) -> None:
    path = small_disk / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    fillers = fill(small_disk, leave_pages=1)
    with pytest.raises(OSError), open(path, "a") as f:  # a plain writer tears the line
        f.write(json.dumps({"step": 2, **big_metrics()}) + "\n")
    assert not path.read_text().endswith("\n")  # torn
    for f in fillers:
        f.unlink()
    resumed = JsonlSink(path, resume_step=1)  # was: JSONDecodeError, forever
    resumed.log(2, {"loss": 0.25})
    resumed.close()
    assert [r["step"] for r in read_jsonl_rows(path)] == [1, 2]


def test_a_torn_line_before_the_end_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON line"):
        JsonlSink(path, resume_step=3)


def test_a_checkpoint_on_a_full_disk_names_the_path(tiny_model_dir: Path, small_disk: Path):
    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    root = small_disk / "checkpoints"
    fillers = fill(small_disk, leave_pages=4)
    with pytest.raises(DiskWriteError) as info:
        save_checkpoint(backend, root, step=1, weight_version="1")
    message = str(info.value)
    assert f"{root}/.tmp-step_000001" in message and "the disk is full" in message, message
    assert "--resume" in message
    assert not list(root.glob(".tmp-*"))  # its space is given back
    for f in fillers:
        f.unlink()
    save_checkpoint(backend, root, step=1, weight_version="1")
    assert [p.name for p in list_checkpoints(root)] == ["step_000001"]


KILLED_MID_DELETE = textwrap.dedent(
    """
    import os, shutil, signal, sys
    from pathlib import Path
    from rollouts.trainer import checkpoint
    from tests.training.test_files_reliability import FileBackend

    root = Path(sys.argv[1])
    checkpoint.save_checkpoint(FileBackend(), root, step=1, weight_version="1", keep_last=1)

    def killed_half_way(path, *args, **kwargs):  # the fault: SIGKILL after one file is gone
        sorted(Path(path).rglob("*.bin"))[0].unlink()
        os.kill(os.getpid(), signal.SIGKILL)

    shutil.rmtree = killed_half_way
    checkpoint.save_checkpoint(FileBackend(), root, step=2, weight_version="2", keep_last=1)
    """
)


class _Done:
    def result(self) -> None:
        return None


class FileBackend:
    """The part of a backend that checkpoints touch: writes a few model files."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def save_checkpoint(self, path: Path) -> _Done:
        for i in range(4):
            (Path(path) / f"shard{i}.bin").write_bytes(b"x" * 1000)
        return _Done()


def test_a_rotation_killed_mid_delete_leaves_no_half_deleted_step(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_DELETE, str(root)], env=env, capture_output=True
    )
    assert done.returncode == -9, done.stderr[-2000:]
    names = sorted(p.name for p in root.iterdir())
    assert "step_000001" not in names, names  # renamed out of the way before the delete
    assert "step_000002" in names
    assert any(n.startswith(".old-step_000001") for n in names), names
    save_checkpoint(FileBackend(), root, step=3, weight_version="3", keep_last=2)  # type: ignore[arg-type]
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step_000002", "step_000003"], names  # the leftover is cleaned
