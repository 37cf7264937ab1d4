"""The removal of default weight copies whose run died (`hold_run_locks` runs it at each start).

A default copy directory `<base>/rollouts-<run>-<hash>` is owned by the flock on
`<base>/rollouts-<run>-<hash>.lock`, taken before the directory is made and dropped only after
it is removed (`driver/lock.py`). The scan takes each such lock without waiting: one it cannot
take belongs to a live run, and is left alone. With the lock in hand, `is_orphan` decides:

- the lock file named a pid: that process is dead (the kernel dropped its lock): remove;
- the lock file names no pid: a run between creating it and writing its pid, unless it is older
  than FRESH_S;
- no lock file at all (left by versions that took none, or that dropped it before removing the
  copies, as a failed start did): the copies are removed once nothing under them changed for
  UNLOCKED_FRESH_S, so a run of such a version that is writing them now keeps them. Only
  directories that look like copies (`copies.looks_like_copies`) are judged so.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from rollouts.driver.lock import LOCK_SUFFIX, release, try_lock
from rollouts.weights.copies import PREFIX, looks_like_copies, newest_mtime

FRESH_S = 60.0  # an empty lock file younger than this may be a run starting: left alone
# copies with no lock file at all whose newest file is younger than this are left alone: a run
# of an older version may be writing them (it publishes a copy every weight sync)
UNLOCKED_FRESH_S = 600.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CopiesSeen:
    """What the scan saw of one default copy directory whose lock it could take (so no live
    process of this version holds it)."""

    owner_named: bool  # its lock file named the pid of the run that took it
    lock_age_s: float | None  # of the lock file found before the scan; None: there was none
    copies_age_s: float | None  # since anything under the directory changed; None: no directory

    def __post_init__(self) -> None:
        assert not (self.owner_named and self.lock_age_s is None), f"{self}: a pid, no lock file"


def is_orphan(seen: CopiesSeen) -> bool:
    """Whether the copies `seen` describes belong to a dead run (the rules: the module doc)."""
    if seen.owner_named:
        return True
    if seen.lock_age_s is not None:
        return seen.lock_age_s >= FRESH_S
    return seen.copies_age_s is not None and seen.copies_age_s >= UNLOCKED_FRESH_S


def _age(path: Path, now: float) -> float | None:
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return None


def _remove_if_orphaned(copies: Path) -> bool:
    """Remove `copies` when `is_orphan` says so; whether it did. Its lock is held meanwhile, so
    no run of this version starts on it halfway through."""
    lock_path = copies.with_name(copies.name + LOCK_SUFFIX)
    lock_age = _age(lock_path, time.time())  # before try_lock creates the file
    lock = try_lock(lock_path, wait=False)
    if lock is None:
        return False  # its run is alive
    try:
        now = time.time()
        copies_age = now - newest_mtime(copies) if copies.is_dir() else None
        seen = CopiesSeen(
            owner_named=lock.previous is not None and lock_age is not None,
            lock_age_s=lock_age,
            copies_age_s=copies_age,
        )
        if not is_orphan(seen):
            return False
        shutil.rmtree(copies, ignore_errors=True)
        return copies_age is not None
    finally:
        release(lock)  # also removes a lock file the scan itself created


def _candidates(base: Path) -> list[Path]:
    """The copy directories under `base` to judge: those with a lock file beside them (made by
    this project), and those without one that look like copies."""
    lock_files = base.glob(f"{PREFIX}*{LOCK_SUFFIX}")
    locked = {p.with_name(p.name[: -len(LOCK_SUFFIX)]) for p in lock_files}
    bare = set()
    for path in base.glob(f"{PREFIX}*"):
        try:
            if path not in locked and looks_like_copies(path):
                bare.add(path)
        except OSError:  # another user's directory: not ours to judge
            continue
    return sorted(locked | bare)


def remove_orphaned_weight_copies(bases: Sequence[Path]) -> list[Path]:
    """Remove the default weight-copy directories under `bases` whose run is dead (with or
    without a lock file); return those removed."""
    removed = []
    for base in bases:
        assert not base.name.startswith(PREFIX), f"{base}: a base, not a copy directory"
        for copies in _candidates(base):
            try:
                gone = _remove_if_orphaned(copies)
            except OSError:  # another user's file, a race with its owner: not ours to clean
                continue
            if gone:
                removed.append(copies)
    return removed
