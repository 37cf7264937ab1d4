"""Write errors that say which file and why: a full disk is named as such, with the path.

torch's zip writer reports a full disk as `unexpected pos 112448 vs 112336`, and a bare OSError
as `[Errno 28] No space left on device` without a path: `write_error` turns either into a
`DiskWriteError` that names the path, the free space and what to do.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

LOW_SPACE_BYTES = 1 << 20  # under 1 MiB free after a failed write: the disk is full


class DiskWriteError(OSError):
    """Writing a run's file failed (the message names the file; `disk_full` says why)."""

    def __init__(self, message: str, *, path: Path, disk_full: bool) -> None:
        super().__init__(errno.ENOSPC if disk_full else errno.EIO, message)
        self.path, self.disk_full = path, disk_full

    def __str__(self) -> str:
        return str(self.args[1])


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def write_error(what: str, path: str | Path, error: BaseException) -> DiskWriteError:
    """A DiskWriteError for `error` raised while writing `what` at `path`."""
    path = Path(path)
    free = free_bytes(path)
    full = (
        getattr(error, "errno", None) == errno.ENOSPC
        or "No space left on device" in str(error)
        or (free is not None and free < LOW_SPACE_BYTES)
    )
    if full:
        message = (
            f"writing {what} {path}: the disk is full ({free} bytes free on its file system); "
            "free some space (or point the run at a larger disk) and resume with --resume"
        )
    else:
        message = f"writing {what} {path} failed: {type(error).__name__}: {error}"
    return DiskWriteError(message, path=path, disk_full=full)
