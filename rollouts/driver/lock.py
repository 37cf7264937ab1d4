"""One run per directory: locks on the run directory and its weight-copy directory, held for the
run's life; the weight copies exist only while their lock is held.

Two runs on one `run.output_dir` (overwrite or not, --resume or not) delete or interleave each
other's files; the second one fails at once, naming the first one's pid, before train.py imports
torch (`driver/cli.py` takes the locks right after reading the config). The lock is an
exclusive `flock` on a small file that holds the owner's pid: the kernel drops it when its
process dies, so a lock left by a dead run is simply taken over (and said so), never guessed
from a pid that may have been reused. The run directory's lock is `<run dir>/run.lock`; the
weight copies' lock sits beside their directory (`/dev/shm/rollouts-<run>-<hash>.lock`, which
the run's own clean-up of that directory leaves alone) or inside a configured
`weight_sync.dir`. It is taken before the copies are made, and on the way out the copies are
removed before it is dropped, whatever ended the run; a killed run's are removed by the next
run (`driver/orphans.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from rollouts.config import Config
from rollouts.trainer.disk_errors import write_error
from rollouts.weights.copies import clean_sync_root, run_sync_root, weight_copy_bases

LOCK_NAME = "run.lock"  # in the run directory
SYNC_LOCK_NAME = "owner.lock"  # in a configured weight_sync.dir
LOCK_SUFFIX = ".lock"  # beside a default weight-copy directory: /dev/shm/rollouts-<run>.lock
BUSY_RETRY_S = 0.2  # a lock briefly held by another run's orphan scan is retried this long


class RunInUse(RuntimeError):
    """Another live process holds this run's lock (the message names it and the way out)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LockOwner:
    """What a lock file says of the process that took it."""

    pid: int
    started: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid}, started {self.started}: {self.command}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HeldLock:
    """An flock we hold on `path` through the open descriptor `fd`."""

    path: Path
    fd: int
    previous: LockOwner | None  # the dead owner it was taken over from, if any


def read_owner(path: Path) -> LockOwner | None:
    """The owner a lock file names (None: no file, empty, or not a lock record)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None
    return LockOwner(
        pid=record["pid"], started=str(record.get("started")), command=str(record.get("command"))
    )


def _owner_record() -> bytes:
    started = datetime.datetime.now().isoformat(timespec="seconds")
    command = " ".join(sys.argv)[:300]
    return json.dumps({"pid": os.getpid(), "started": started, "command": command}).encode()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (its holder may have unlinked it)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _flock_now(fd: int) -> bool:
    deadline = time.monotonic() + BUSY_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def try_lock(path: Path, *, wait: bool = True) -> HeldLock | None:
    """Take the lock at `path` (creating the file) and write our pid in it; None when another
    live process holds it. `wait=False` gives up at once (the orphan scan)."""
    for _ in range(5):  # a holder that unlinks its file as we open it: open it again
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except BlockingIOError:
            taken = wait and _flock_now(fd)
        if not taken:
            os.close(fd)
            return None
        if _same_file(fd, path):
            return HeldLock(path=path, fd=fd, previous=read_owner(path))
        os.close(fd)
    raise RuntimeError(f"{path}: the lock file keeps being replaced; is another run starting?")


def _write_owner(lock: HeldLock, what: str) -> None:
    try:
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, _owner_record(), 0)
    except OSError as e:  # a full disk: the path and what to do, not a bare [Errno 28]
        release(lock)
        raise write_error(what, lock.path, e) from e


def release(lock: HeldLock) -> None:
    """Remove the lock file, then drop the lock (a run that opened it meanwhile sees it gone)."""
    with contextlib.suppress(FileNotFoundError):
        if _same_file(lock.fd, lock.path):
            lock.path.unlink()
    os.close(lock.fd)


def acquire(path: Path, what: str, fix: str) -> HeldLock:
    """The lock at `path` for this run, or RunInUse naming the live owner and `fix`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = try_lock(path)
    if lock is None:
        owner = read_owner(path)
        who = owner.describe() if owner is not None else "a process that has not written its pid"
        raise RunInUse(f"{what} is in use by another run ({who}); {fix}")
    _write_owner(lock, f"the lock file of {what}")
    if lock.previous is not None and lock.previous.pid != os.getpid():
        print(
            f"[train] {what}: taking over the lock of pid {lock.previous.pid}, which is no "
            "longer running",
            flush=True,
        )
    return lock


def sync_lock_path(root: Path, configured: bool) -> Path:
    """Where the weight copies' lock lives: inside a configured directory (its clean-up keeps
    other files), beside a default one (its clean-up removes the whole directory)."""
    return root / SYNC_LOCK_NAME if configured else root.with_name(root.name + LOCK_SUFFIX)


@contextlib.contextmanager
def hold_run_locks(config: Config, bases: Sequence[Path] | None = None) -> Iterator[Path]:
    """Hold the locks of `config`'s run directory and weight-copy directory while the body runs
    (yields the run directory); first remove the weight copies of dead runs under `bases`
    (default: `copies.weight_copy_bases`). On the way out, whatever ended the body (a finished
    run, an engine that never came up, any error), the run's own weight copies are removed
    before their lock is dropped, so no copy directory outlives its owner's lock. Light: no
    torch, so train.py takes it before the heavy imports."""
    from rollouts.driver.orphans import remove_orphaned_weight_copies

    run_dir = Path(config.run.output_dir)
    configured = bool(config.weight_sync.dir)
    sync_root = run_sync_root(config.weight_sync.dir, config.run.name, run_dir)
    locks: list[HeldLock] = []
    try:
        fix = "wait for it to end or stop it, or choose another run.output_dir"
        locks.append(acquire(run_dir / LOCK_NAME, f"run.output_dir = {str(run_dir)!r}", fix))
        what = f"the weight-copy directory {str(sync_root)!r}"
        fix = "give each run its own weight_sync.dir"
        locks.append(acquire(sync_lock_path(sync_root, configured), what, fix))
        for copies in remove_orphaned_weight_copies(
            weight_copy_bases() if bases is None else bases
        ):
            print(f"[train] removed the weight copies of a run that died: {copies}", flush=True)
        yield run_dir
    finally:
        if len(locks) == 2:  # ours: removed while we still own them
            clean_sync_root(sync_root, configured)
        for lock in reversed(locks):
            release(lock)
