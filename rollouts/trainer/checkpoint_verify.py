"""What a checkpoint's manifest says of its files, and whether the files on disk still say it.

Each file of a checkpoint directory (every backend's: model/ safetensors, optimizer.pt or the
FSDP `optimizer/` DCP shards of every rank, adapter/, value_head.pt, reference.safetensors, RNG,
extra_state.json ...) is recorded in `manifest.json` with its size and its CRC-32
(`{"size": 123, "crc32": "89abcdef"}`, manifest format 2). CRC-32 (zlib) is the fastest of the
standard library's checks on the machines measured (`scripts/bench_checkpoint_hash.py`: about
2.5x sha256 and 6x blake2b), and it catches what happens to files on disk (torn writes, flipped
or overwritten bytes, truncation); it is not a defence against someone forging a checkpoint.

The files are hashed right after they are written, while they are still in the page cache.
Verification reads each file once. Format 1 manifests (sizes only, written before checksums)
are verified by size, and say so (`Verdict.checksummed`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
HASH = "crc32"
CHUNK_BYTES = 8 << 20  # read in 8 MiB pieces: memory stays flat for multi-GB files
MAX_HASH_THREADS = 8  # files hashed at once (FSDP: one optimizer shard per rank)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    """One file as the manifest records it (crc32 None: a format 1 manifest, sizes only)."""

    size: int
    crc32: str | None = None

    def __post_init__(self) -> None:
        assert self.size >= 0, f"{self.size=} must be >= 0"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A file of a checkpoint that is not what its manifest says: `what` is "missing",
    "size 123 != 456" (on disk != recorded) or "checksum mismatch (crc32 ... != ...)"."""

    file: str
    what: str

    def describe(self) -> str:
        return f"{self.file}: {self.what}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """A checkpoint directory checked against its manifest (step -1: the manifest is
    unreadable, so the step it records is unknown)."""

    path: Path
    step: int
    problems: tuple[Problem, ...] = ()
    checksummed: bool = True  # False: a format 1 manifest, sizes checked only

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """The problems, one clause each: `model/model.safetensors: checksum mismatch (...)`."""
        return "; ".join(p.describe() for p in self.problems) or "intact"


def file_crc32(path: Path) -> tuple[int, str]:
    """The size of `path` and its CRC-32 as 8 hex digits, reading it once in pieces."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    assert size == path.stat().st_size, f"{path}: read {size} bytes of {path.stat().st_size}"
    return size, f"{crc:08x}"


def _crc32_all(files: list[Path]) -> list[tuple[int, str]]:
    """`file_crc32` of each of `files`, several at once (zlib lets go of the GIL while it
    hashes: a model file and an optimizer file take the time of the larger)."""
    workers = max(1, min(len(files), os.cpu_count() or 1, MAX_HASH_THREADS))
    if workers == 1:
        return [file_crc32(f) for f in files]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="crc32") as pool:
        return list(pool.map(file_crc32, files))


def record_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file under `directory` but the manifest, as manifest entries
    (`{"model/model.safetensors": {"size": ..., "crc32": ...}}`), sorted by path."""
    files = [f for f in sorted(directory.rglob("*")) if f.is_file() and f.name != MANIFEST]
    return {
        str(f.relative_to(directory)): {"size": size, HASH: crc}
        for f, (size, crc) in zip(files, _crc32_all(files), strict=True)
    }


def parse_records(files: Any) -> dict[str, FileRecord]:
    """The manifest's `files` as records: format 2 (`{"size", "crc32"}`) or 1 (a size alone).
    Raises ValueError naming the entry that is neither."""
    if not isinstance(files, dict):
        raise ValueError(f"'files' is a {type(files).__name__}, not a table")
    out: dict[str, FileRecord] = {}
    for rel, entry in files.items():
        if isinstance(entry, int):
            out[rel] = FileRecord(size=entry)
        elif isinstance(entry, dict) and isinstance(entry.get("size"), int):
            crc = entry.get(HASH)
            out[rel] = FileRecord(size=entry["size"], crc32=None if crc is None else str(crc))
        else:
            raise ValueError(f"files[{rel!r}] = {entry!r}: neither a size nor {{size, {HASH}}}")
    return out


def compare(rel: str, recorded: FileRecord, size: int | None, crc32: str | None) -> Problem | None:
    """The problem of one file (None when it matches): `size` None means it is missing, and
    `crc32` None that it was not hashed (no checksum recorded, or the size already differs)."""
    if size is None:
        return Problem(file=rel, what="missing")
    if size != recorded.size:
        return Problem(file=rel, what=f"size {size} != {recorded.size} (on disk != manifest)")
    if recorded.crc32 is not None and crc32 is not None and crc32 != recorded.crc32:
        what = f"checksum mismatch ({HASH} {crc32} != {recorded.crc32}, on disk != manifest)"
        return Problem(file=rel, what=what)
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """`path/manifest.json`, parsed (OSError, ValueError when unreadable)."""
    manifest = json.loads((path / MANIFEST).read_text())
    if not isinstance(manifest, dict):
        raise ValueError(f"a {type(manifest).__name__}, not a table")
    return manifest


def verify_checkpoint(path: Path) -> Verdict:
    """Check every file `path/manifest.json` names: there, of its size, and (format 2) of its
    checksum. Each file is read once; a file whose size differs is not read at all."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        step = int(manifest["step"])
        records = parse_records(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = Problem(file=MANIFEST, what=f"unreadable ({type(e).__name__}: {e})")
        return Verdict(path=path, step=-1, problems=(problem,))
    present = {rel: (path / rel).stat().st_size for rel in records if (path / rel).is_file()}
    to_hash = [  # only files of the recorded size, with a recorded checksum: each read once
        rel for rel, r in records.items() if present.get(rel) == r.size and r.crc32 is not None
    ]
    hashed = dict(zip(to_hash, _crc32_all([path / rel for rel in to_hash]), strict=True))
    problems = [
        problem
        for rel, recorded in records.items()
        if (problem := compare(rel, recorded, present.get(rel), hashed.get(rel, (0, None))[1]))
    ]
    checksummed = all(r.crc32 is not None for r in records.values())
    return Verdict(path=path, step=step, problems=tuple(problems), checksummed=checksummed)


def add_to_manifest(path: Path, subdir: str) -> None:
    """Record the files written under `path/subdir` after the checkpoint was finished (the
    merged model/ of a LoRA SFT checkpoint), so that the manifest still names every file.
    The manifest is replaced by rename: a kill leaves the old one or the new one."""
    manifest = read_manifest(path)
    added = {f"{subdir}/{rel}": entry for rel, entry in record_files(path / subdir).items()}
    assert added, f"{path / subdir}: no files to add to the manifest"
    manifest["files"] = {**manifest["files"], **added}
    tmp = path / f".tmp-{MANIFEST}"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(path / MANIFEST)
