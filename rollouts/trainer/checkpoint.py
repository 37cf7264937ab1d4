"""Checkpoints: `step_NNNNNN/` directories written atomically, found and resumed.

Layout of one checkpoint (the backend writes the model part):
    step_000012/
      model/            HF safetensors + config + tokenizer (transformers, vLLM, SGLang load it)
      optimizer.pt | optimizer/ (DCP, under FSDP), scheduler.pt, backend.json
      rng_rank{R}.pt    python, numpy, torch (and CUDA) RNG states of each rank
      extra_state.json  the caller's JSON-safe state (DataBuffer.state_dict(), partial samples)
      reference.safetensors  the reference model's parameters, once an update (copy, ema,
                        periodic, user) has moved them off the base model; a resume loads them
      manifest.json     written last: step, weight version, every file with its size and
                        CRC-32 (`checkpoint_verify.py`; hashed right after the files are written)
Everything is written into `.tmp-step_NNNNNN/` and renamed, so a crash never leaves a directory
named `step_*` that is incomplete; `find_latest_checkpoint` also checks the manifest's sizes.
A resume verifies the checksums too (`driver/resume.py`: a corrupt checkpoint stops the run).
A checkpoint is deleted (rotation, replacement) by renaming it to `.old-step_NNNNNN-<ns>` first,
so a kill mid-delete never leaves a half-deleted `step_*`; `clean_leftovers` removes `.tmp-*` and
`.old-*` directories at the next save and at the start of a run. A write that fails (a full
disk) removes its `.tmp-` directory and raises a `DiskWriteError` naming the path.

The best checkpoint: when a save is given the step's metrics and a `BestSpec`
(`checkpoint.best_metric`, `checkpoint.best_mode`), `best.json` in the checkpoints root names the
checkpoint with the best value seen so far (step, directory, metric, value); that directory is
exempt from the keep-last-K rotation, so the root holds the last K plus the best.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import time
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollouts.config.training import BestMode
from rollouts.trainer.checkpoint_verify import MANIFEST, parse_records, read_manifest, record_files
from rollouts.trainer.disk_errors import write_error
from rollouts.trainer.protocol import TrainingBackend

REFERENCE_FILE = "reference.safetensors"
EXTRA_STATE = "extra_state.json"
FORMAT = 2  # 2: each file's size and crc32; 1 (older checkpoints, still loaded): sizes only
FORMATS = (1, 2)
BEST_FILE = "best.json"
BEST_MODES = typing.get_args(BestMode)
STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointState:
    """What a loop gets back from a resumed checkpoint."""

    path: Path
    step: int
    weight_version: str
    extra_state: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BestSpec:
    """Which step metric picks the best checkpoint, and whether higher ("max") is better."""

    metric: str = "eval/accuracy"
    mode: BestMode = "max"

    def __post_init__(self) -> None:
        assert self.metric, "BestSpec.metric is empty (no best tracking: pass best=None)"
        assert self.mode in BEST_MODES, f"{self.mode=} not in {BEST_MODES}"


def is_better(value: float, best: float | None, mode: BestMode) -> bool:
    """`value` beats the recorded `best` (None: nothing recorded yet); ties keep the older one."""
    assert mode in BEST_MODES, f"{mode=} not in {BEST_MODES}"
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The `best.json` record of `root` ({step, name, metric, value, mode}), or None when there
    is none or the checkpoint it names is gone or incomplete."""
    root = Path(root)
    try:
        record = json.loads((root / BEST_FILE).read_text())
        name = str(record["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if is_complete(root / name) else None


def find_best_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `best.json` names (complete), or None."""
    record = read_best(root)
    return None if record is None else Path(root) / str(record["name"])


def _best_update(
    root: Path, step: int, metrics: Mapping[str, Any] | None, best: BestSpec | None
) -> dict[str, Any] | None:
    """The new `best.json` record if step `step`'s metrics beat the recorded best, else None."""
    if best is None or not metrics or best.metric not in metrics:
        return None
    value = float(metrics[best.metric])
    current = read_best(root)
    same_spec = current is not None and current.get("metric") == best.metric
    recorded = float(current["value"]) if same_spec and current is not None else None
    if not is_better(value, recorded, best.mode):
        return None
    name = checkpoint_name(step)
    return {"step": step, "name": name, "metric": best.metric, "value": value, "mode": best.mode}


def checkpoint_name(step: int) -> str:
    """`step_000012` for step 12."""
    assert step >= 0, f"{step=} must be >= 0"
    return f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, as lists and tensors (safe to load weights_only)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())


def is_complete(path: Path) -> bool:
    """A manifest that parses and names files that are all there with their sizes (cheap: no
    checksum; `checkpoint_verify.verify_checkpoint` reads the files)."""
    try:
        records = parse_records(read_manifest(path)["files"])
        return all((path / rel).stat().st_size == r.size for rel, r in records.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (incomplete ones are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if p.is_dir() and is_complete(p)]


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    _write_json(tmp, data)
    tmp.rename(path)


def _delete(path: Path) -> None:
    """Rename `path` out of the `step_*` namespace, then delete it (a kill mid-way leaves only a
    `.old-*` directory, removed by `clean_leftovers`)."""
    old = path.with_name(f".old-{path.name}-{time.time_ns()}")
    path.rename(old)
    shutil.rmtree(old)


def clean_leftovers(root: str | Path) -> None:
    """Remove what a crashed save or delete left under `root` (`.tmp-step_*`, `.old-step_*`)."""
    root = Path(root)
    if not root.is_dir():
        return
    for leftover in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _publish(tmp: Path, final: Path, keep_last: int, new_best: dict[str, Any] | None) -> None:
    """Rename `tmp` to `final` (replacing an older one of the same step), record a new best, and
    prune all but the last `keep_last` and the best (rank 0)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}-{time.time_ns()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    if new_best is not None:
        _write_json_atomic(final.parent / BEST_FILE, new_best)
    best = find_best_checkpoint(final.parent)
    for stale in list_checkpoints(final.parent)[:-keep_last]:
        if stale != best:
            _delete(stale)


def save_checkpoint(
    backend: TrainingBackend,
    root: str | Path,
    *,
    step: int,
    weight_version: str,
    extra_state: dict[str, Any] | None = None,
    keep_last: int = 2,
    metrics: Mapping[str, Any] | None = None,
    best: BestSpec | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `root/step_NNNNNN` atomically and keep the last `keep_last`; every rank calls it.

    `reference`: the reference model's parameters (rank 0's full copy), saved when it is no
    longer the base model, so that a resumed run trains against the same reference.

    With `best` and the step's `metrics`: when `metrics[best.metric]` beats the value in
    `root/best.json`, this checkpoint becomes the best (recorded there, and kept through the
    rotation). A step whose metrics lack `best.metric` (no eval that step) is never the best.
    """
    assert keep_last >= 1, f"{keep_last=}"
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"
    if backend.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_leftovers(root)  # from a crashed save or delete: never complete
            tmp.mkdir()
        except OSError as e:
            raise write_error("checkpoint", tmp, e) from e
    backend.barrier()
    try:
        backend.save_checkpoint(tmp).result()
        torch.save(rng_state(), tmp / f"rng_rank{backend.rank}.pt")
    except Exception as e:  # torch: "unexpected pos ..."; safetensors: SafetensorError
        error = write_error("checkpoint", tmp, e)  # before the cleanup frees the space
        shutil.rmtree(tmp, ignore_errors=True)
        if error.disk_full or isinstance(e, OSError):
            raise error from e
        raise
    backend.barrier()
    if backend.rank == 0:
        try:
            _finish(tmp, step, weight_version, extra_state, backend.world_size, reference)
            _publish(tmp, final, keep_last, _best_update(root, step, metrics, best))
        except Exception as e:  # safetensors (the reference) raises SafetensorError
            error = write_error("checkpoint", tmp, e)
            shutil.rmtree(tmp, ignore_errors=True)
            if error.disk_full or isinstance(e, OSError):
                raise error from e
            raise
    backend.barrier()
    return final


def save_reference_params(params: Mapping[str, torch.Tensor], path: Path) -> None:
    """The reference parameters as safetensors (copied: tied or shared tensors are fine)."""
    from safetensors.torch import save_file

    assert params, "no reference parameters to save"
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in params.items()}, path)


def load_reference_params(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The reference parameters a checkpoint saved, or None when it saved none (the reference
    was still the base model)."""
    from safetensors.torch import load_file

    file = Path(path) / REFERENCE_FILE
    return load_file(file) if file.is_file() else None


def _finish(
    tmp: Path,
    step: int,
    weight_version: str,
    extra_state: dict[str, Any] | None,
    world_size: int,
    reference: Mapping[str, torch.Tensor] | None,
) -> None:
    """The extra state and reference, then the manifest (last: it makes the directory complete)."""
    _write_json(tmp / EXTRA_STATE, extra_state or {})
    if reference is not None:
        save_reference_params(reference, tmp / REFERENCE_FILE)
    manifest = {
        "format": FORMAT,
        "step": step,
        "weight_version": weight_version,
        "world_size": world_size,
        "created_unix": time.time(),
        "files": record_files(tmp),  # just written: read back from the page cache
    }
    _write_json(tmp / MANIFEST, manifest)


def load_checkpoint(backend: TrainingBackend, path: str | Path) -> CheckpointState:
    """Restore model, optimizer, schedule, counters and RNG from `path`; every rank calls it."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no valid {MANIFEST})")
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] in FORMATS, f"{path}: checkpoint format {manifest['format']}"
    backend.load_checkpoint(path).result()
    rng_file = path / f"rng_rank{backend.rank}.pt"
    if not rng_file.is_file():  # resumed with more ranks than were saved
        rng_file = path / "rng_rank0.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return CheckpointState(
        path=path,
        step=int(manifest["step"]),
        weight_version=str(manifest["weight_version"]),
        extra_state=json.loads((path / EXTRA_STATE).read_text()),
    )
