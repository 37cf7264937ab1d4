"""The weight files the engines load: weights-only HF files (no optimizer) or the LoRA adapter
alone, in a fast local directory (/dev/shm by default), each version written to a temporary
name and renamed, the last K kept (`disk.py` has the engines load them)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollouts.trainer.disk_errors import write_error
from rollouts.trainer.protocol import LoraAdapters, TrainingBackend


def publish_weights(
    backend: TrainingBackend,
    root: str | Path,
    version: str,
    *,
    keep_last: int = 2,
    weights: Any = None,
) -> Path:
    """Write weights-only HF files to `root/v_<version>` (atomically), prune older versions.

    Every rank calls it (FSDP gathers on rank 0). Blocking: run it with trio.to_thread.run_sync.
    `weights`, a `snapshot_weights` copy, are written by the backend's `write_weights` (the
    one-process backend on this thread, the trainer process on its writer thread; the training
    thread is free to go on); without them the backend saves its current weights on its own thread.
    """
    assert keep_last >= 1, f"{keep_last=}"
    root = Path(root)
    final = root / f"v_{version}"
    tmp = root / f".tmp-v_{version}"
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        _recycle(root, tmp, keep_last)
    backend.barrier()
    with _named_errors("the weight-sync copy (weight_sync.dir)", tmp):
        snapshots = backend.weight_snapshots()
        if weights is None or snapshots is None:
            assert weights is None, "a snapshot from a backend that takes none"
            backend.save_weights(tmp).result()
        else:
            snapshots.write_weights(weights, tmp)
    if backend.rank == 0:
        os.utime(tmp)  # files rewritten in place leave a recycled directory's time as it was
        _swap_in(tmp, final, keep_last)
    backend.barrier()
    return final


@contextlib.contextmanager
def _named_errors(what: str, tmp: Path) -> Iterator[None]:
    """A write of `tmp` that fails leaves nothing behind; a full disk (a full /dev/shm:
    weight_sync.dir moves it) or another OSError is raised named (`write_error`)."""
    try:
        yield
    except Exception as e:
        error = write_error(what, tmp, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if error.disk_full or isinstance(e, OSError):
            raise error from e
        raise


def _versions(root: Path, but: Path | None = None) -> list[Path]:
    """The `v_*` directories under `root` (not `but`), oldest first."""
    return sorted((p for p in root.glob("v_*") if p != but), key=lambda p: p.stat().st_mtime)


def _recycle(root: Path, tmp: Path, keep_last: int) -> None:
    """Rename the version this publish will prune to `tmp`, so that the files are rewritten in
    place: a tmpfs then reuses its pages instead of allocating (and later freeing) a model's
    worth of new ones each sync (`scripts/bench_weight_write.py`). Only with `keep_last` >= 2:
    the recycled version is then never the newest, the one engines load or restart on (a
    publish starts after the previous delivery ended, `OverlappedPublisher.settle`)."""
    olds = _versions(root)
    if keep_last >= 2 and len(olds) >= keep_last:
        olds[0].rename(tmp)


def _swap_in(tmp: Path, final: Path, keep_last: int) -> None:
    """Rename `tmp` to `final` and keep only the `keep_last` newest `v_*` beside it."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    olds = _versions(final.parent, but=final)
    for old in olds[: max(len(olds) - (keep_last - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def publish_adapter(
    adapters: LoraAdapters, root: str | Path, version: str, *, keep_last: int = 2
) -> tuple[Path, int]:
    """Write the LoRA adapter alone to `root/v_<version>` (atomically, in order after the
    trainer's submitted work), prune older versions; (its directory, its bytes). Blocking."""
    assert keep_last >= 1, f"{keep_last=}"
    root = Path(root)
    final, tmp = root / f"v_{version}", root / f".tmp-v_{version}"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    with _named_errors("the adapter copy (weight_sync.dir)", tmp):
        size = adapters.save_adapter(tmp).result()
    _swap_in(tmp, final, keep_last)
    return final, size


def weight_bytes(path: Path) -> int:
    """The bytes of the weight files in `path` (what a disk sync moves)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))
