"""Where a run's weight copies for the engines live, and their removal; no torch, so the run lock
(`driver/lock.py`) takes them into account before the heavy imports.

A default copy directory is `<base>/rollouts-<run name>-<hash of the run dir>`, the base being
/dev/shm (else the temp dir), or `$ROLLOUTS_WEIGHT_COPIES` when set (tests point it at their own
temporary directory, so they never touch other runs' copies). A configured `weight_sync.dir` is
the user's: only our `v_*` copies in it are ever removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

BASE_ENV = "ROLLOUTS_WEIGHT_COPIES"  # one directory that replaces /dev/shm and the temp dir
PREFIX = "rollouts-"
DIGEST_CHARS = 10  # of the run directory's sha1, at the end of a default copy directory's name
COPY_GLOBS = ("v_*", ".tmp-v_*")  # what a run writes in its copy directory


def weight_copy_bases(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The directories default weight copies go to, in order of preference: `$ROLLOUTS_WEIGHT_
    COPIES` alone when set, else /dev/shm and the temp dir (those that exist)."""
    env = os.environ if environ is None else environ
    if env.get(BASE_ENV):
        return [Path(env[BASE_ENV])]
    bases = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    return [b for b in dict.fromkeys(bases) if b.is_dir()]


def default_sync_root(configured: str, run_name: str) -> Path:
    """`weight_sync.dir`, else `<base>/rollouts-<run>`: /dev/shm when it has room, else the temp
    dir (or `$ROLLOUTS_WEIGHT_COPIES`)."""
    if configured:
        return Path(configured)
    bases = weight_copy_bases()
    usable = [b for b in bases if b.is_dir() and shutil.disk_usage(b).free > 0]
    base = (usable or bases or [Path(tempfile.gettempdir())])[0]
    return base / f"{PREFIX}{run_name}"


def run_sync_root(configured: str, run_name: str, run_dir: str | Path) -> Path:
    """The weight-sync root of a run: named by the run (its name and a hash of its directory),
    not by the process, so a resumed run finds (and cleans) what a crashed one left behind."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:DIGEST_CHARS]
    return default_sync_root(configured, f"{run_name}-{digest}")


def clean_sync_root(root: Path, configured: bool) -> None:
    """Remove the weight copies under `root` (at start and on exit): the whole directory when
    it is ours (/dev/shm or the temp dir), only our `v_*` copies in a configured one."""
    if not configured:
        shutil.rmtree(root, ignore_errors=True)
        return
    for pattern in COPY_GLOBS:
        for old in root.glob(pattern):
            shutil.rmtree(old, ignore_errors=True)


def looks_like_copies(path: Path) -> bool:
    """Whether `path` is a default weight-copy directory by its name (`rollouts-<run>-<10 hex>`)
    and its contents (only `v_*` / `.tmp-v_*` entries), as every version of the project left
    them; a run directory or anything else named `rollouts-*` is not."""
    pattern = rf"{re.escape(PREFIX)}.+-[0-9a-f]{{{DIGEST_CHARS}}}"
    if not re.fullmatch(pattern, path.name) or path.is_symlink() or not path.is_dir():
        return False
    return all(entry.name.startswith(("v_", ".tmp-v_")) for entry in path.iterdir())


def newest_mtime(path: Path) -> float:
    """The newest modification time of `path` and everything under it (a copy being written
    has fresh files), without following links; 0.0 for a path that is gone."""
    newest = 0.0
    for top, dirs, files in os.walk(path):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            try:
                newest = max(newest, os.lstat(name).st_mtime)
            except FileNotFoundError:
                continue
    return newest
