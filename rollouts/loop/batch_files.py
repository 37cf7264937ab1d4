"""The batches a run trained, on disk, and read back for a replay (`logging.save_batches`,
`--rollout-only`, `--replay RUN`).

    RUN/batches/step_000001/batch.json            what a person reads: the step, the batch
                                                  number, the version it trained at, the config
                                                  keys that shape a batch, the rollout batch's
                                                  statistics and each sample's prompt, label,
                                                  reward, status, weight versions and metadata
    RUN/batches/step_000001/tensors.safetensors   every per-token array, one flat tensor a field
                                                  and each sample's lengths: the token ids, loss
                                                  masks, the engine's (and a teacher's) logprobs
                                                  in float64, as sampled; and `trained.*`: the
                                                  TrainBatch the step trained on (advantages,
                                                  old and reference logprobs, returns, values)

Two files: JSON for what one inspects (`jq`), safetensors for the arrays: binary and exact (the
engine's logprobs are Python floats, kept as float64), no pickle (a replay may read a run from
elsewhere), one contiguous buffer a field so a step's save costs little. A step is written into
`.tmp-step_NNNNNN/` and renamed, as checkpoints are: a kill never leaves half a step under its name.
A replay rebuilds the samples exactly (`Sample` equality) and trains them through the same step
code; the `trained.*` tensors are the record of what was trained, compared by the tests.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import trio
from safetensors.torch import load_file, save_file

from rollouts.config import Config
from rollouts.types import Sample, TrainBatch, sample_from_dict, sample_to_dict

FORMAT = 1
BATCHES_DIR = "batches"
JSON_NAME = "batch.json"
TENSORS_NAME = "tensors.safetensors"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
PER_TOKEN = ("tokens", "loss_mask", "rollout_logprobs", "teacher_logprobs")
TRAINED = ("advantages", "old_logprobs", "ref_logprobs", "returns", "old_values")
Group = tuple[Sample, ...]


class BatchFileError(ValueError):
    """A batch that cannot be stored (a value JSON cannot hold), or a stored one a replay cannot
    use: missing, unreadable, or of another shape than the config's (the message names the file
    and the key)."""


def shape_of(config: Config) -> dict[str, int]:
    """The config keys that shape a batch: a replay under other values is refused."""
    r = config.rollout
    return {
        "rollout.batch_size": r.batch_size,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout.sampling.max_new_tokens": r.sampling.max_new_tokens,
    }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoredBatch:
    """One step's batch as it was trained (or, rollout-only, as it would be)."""

    step: int
    number: int  # the batch number (its sampling seeds and DataBuffer state)
    version: int  # the policy version it was trained at (rollout-only: the base, 0)
    groups: tuple[Group, ...]
    metadata: Mapping[str, Any]  # the rollout batch's statistics (RolloutBatch.metadata)
    shape: Mapping[str, int]  # `shape_of` the config that made it
    trained: TrainBatch | None = None  # the step's TrainBatch; None: not trained (rollout-only)

    def __post_init__(self) -> None:
        assert self.step >= 1, f"{self.step=}"
        assert self.number >= self.step, f"{self.number=} < {self.step=}"
        n = sum(len(g) for g in self.groups)
        assert self.trained is None or len(self.trained) == n, f"{len(self.trained)=} != {n=}"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def stored_steps(root: Path) -> list[int]:
    """The steps stored under `root`, in order."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


def _flat(values: Sequence[Sequence[Any]], code: str, dtype: torch.dtype) -> torch.Tensor:
    packed = array.array(code)
    for v in values:
        packed.extend(v)
    if not packed:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(packed, dtype=dtype)


def _tensors(samples: Sequence[Sample], trained: TrainBatch | None) -> dict[str, torch.Tensor]:
    """Every per-token array of `samples` (and of the TrainBatch) as flat tensors + lengths."""
    out = {
        "tokens": _flat([s.tokens for s in samples], "q", torch.int64),
        "loss_mask": _flat([s.loss_mask for s in samples], "B", torch.uint8),
        "rollout_logprobs": _flat([s.rollout_logprobs for s in samples], "d", torch.float64),
        "teacher_logprobs": _flat([s.teacher_logprobs for s in samples], "d", torch.float64),
    }
    for name in PER_TOKEN:
        out[f"n_{name}"] = _flat([[len(getattr(s, name))] for s in samples], "q", torch.int64)
    for name in TRAINED if trained is not None else ():
        field = getattr(trained, name)
        if field:
            assert [len(t) for t in field] == [len(s.tokens) for s in samples], name
            out[f"trained.{name}"] = torch.cat([t.detach().cpu() for t in field]).contiguous()
    return out


def _header(stored: StoredBatch) -> dict[str, Any]:
    groups = []
    for group in stored.groups:
        rows = [sample_to_dict(s) for s in group]
        groups.append([{k: v for k, v in row.items() if k not in PER_TOKEN} for row in rows])
    t = stored.trained
    normalisers = None
    if t is not None:
        normalisers = {
            "num_global_tokens": t.num_global_tokens,
            "num_global_seqs": t.num_global_seqs,
            "max_response_length": t.max_response_length,
        }
    return {
        "format": FORMAT,
        "step": stored.step,
        "batch_number": stored.number,
        "trained_at_version": stored.version,
        "shape": dict(stored.shape),
        "trained": normalisers,
        "metadata": dict(stored.metadata),
        "groups": groups,
    }


def write_batch(root: Path, stored: StoredBatch) -> Path:
    """Write `stored` as `root/step_NNNNNN/` (replacing one of the same step): both files into
    `.tmp-step_NNNNNN/`, then one rename."""
    samples = [s for g in stored.groups for s in g]
    final = step_dir(root, stored.step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_tensors(samples, stored.trained), str(tmp / TENSORS_NAME))
    try:
        header = json.dumps(_header(stored))
    except (TypeError, ValueError) as e:  # a sample's metadata or label JSON cannot hold
        shutil.rmtree(tmp, ignore_errors=True)
        raise BatchFileError(
            f"{final}: the batch holds a value JSON cannot write ({e}); keep samples' metadata "
            "and labels JSON-safe, or set logging.save_batches = false"
        ) from e
    (tmp / JSON_NAME).write_text(header)
    if final.exists():  # a resumed run trains this step again
        old = root / f".old-{final.name}-{time.time_ns()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def _split(flat: list[Any], lengths: list[int]) -> list[tuple[Any, ...]]:
    out, start = [], 0
    for n in lengths:
        out.append(tuple(flat[start : start + n]))
        start += n
    assert start == len(flat), f"lengths sum to {start}, the tensor holds {len(flat)}"
    return out


def _samples(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[Group, ...]:
    rows = [row for group in header["groups"] for row in group]
    fields = {}
    for name in PER_TOKEN:
        lengths = tensors[f"n_{name}"].tolist()
        assert len(lengths) == len(rows), f"{name}: {len(lengths)=} != {len(rows)=}"
        fields[name] = _split(tensors[name].tolist(), lengths)
    samples = iter(
        sample_from_dict(row | {name: fields[name][i] for name in PER_TOKEN})
        for i, row in enumerate(rows)
    )
    return tuple(tuple(next(samples) for _ in group) for group in header["groups"])


def _trained(
    header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], groups: tuple[Group, ...]
) -> TrainBatch | None:
    if header["trained"] is None:
        return None
    samples = [s for g in groups for s in g]
    lengths = [len(s.tokens) for s in samples]
    fields = {
        name: tuple(tensors[f"trained.{name}"].split(lengths))
        for name in TRAINED
        if f"trained.{name}" in tensors
    }
    return TrainBatch(
        input_ids=tuple(torch.tensor(s.tokens, dtype=torch.long) for s in samples),
        loss_mask=tuple(torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples),
        **fields,
        **header["trained"],
    )


def read_batch(root: Path, step: int) -> StoredBatch:
    """Step `step`'s batch from `root` (a BatchFileError naming the file when it is missing or
    unreadable)."""
    where = step_dir(root, step)
    if not where.is_dir():
        have = stored_steps(root)
        held = f"steps {have[0]}..{have[-1]}" if have else "no step"
        raise BatchFileError(
            f"{where}: missing ({root} holds {held}); set training.rl_steps to at most the "
            "last step stored, or replay a run that stored this one (logging.save_batches)"
        )
    try:
        header = json.loads((where / JSON_NAME).read_text())
        tensors = load_file(str(where / TENSORS_NAME))
    except (OSError, ValueError) as e:
        raise BatchFileError(f"{where}: unreadable ({e})") from e
    if header.get("format") != FORMAT:
        raise BatchFileError(
            f"{where / JSON_NAME}: format = {header.get('format')!r}, this version reads {FORMAT}"
        )
    groups = _samples(header, tensors)
    return StoredBatch(
        step=int(header["step"]),
        number=int(header["batch_number"]),
        version=int(header["trained_at_version"]),
        groups=groups,
        metadata=header["metadata"],
        shape=header["shape"],
        trained=_trained(header, tensors, groups),
    )


def check_shape(config: Config, stored_shape: Mapping[str, int], where: Path) -> None:
    """A BatchFileError naming the file and the first key whose value differs from `config`'s."""
    for key, value in shape_of(config).items():
        if key in stored_shape and stored_shape[key] != value:
            raise BatchFileError(
                f"{where}: stored with {key} = {stored_shape[key]}, this run's config has "
                f"{key} = {value}: replay with --set {key}={stored_shape[key]}"
            )


def check_replay(config: Config, root: Path, first: int, last: int) -> None:
    """Before anything is built: steps `first..last` are all stored under `root`, and the first
    of them has this config's shape (each later one is checked as it is read)."""
    have = set(stored_steps(root))
    for step in range(first, last + 1):
        if step not in have:
            read_batch(root, step)  # raises, naming the file and what the run holds
    if first <= last:
        where = step_dir(root, first) / JSON_NAME
        try:
            shape = json.loads(where.read_text())["shape"]
        except (OSError, ValueError, KeyError) as e:
            raise BatchFileError(f"{where}: unreadable ({e!r})") from e
        check_shape(config, shape, where)


class BatchWriter:
    """Writes each step's batch under `root` (`write_batch`) off the trio thread; made once
    per run, when it removes what a crash left and the steps after `start_step` (a resumed run
    trains them again)."""

    def __init__(self, root: Path, config: Config, start_step: int) -> None:
        self.root = root
        self.shape = shape_of(config)
        root.mkdir(parents=True, exist_ok=True)
        for leftover in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        for step in stored_steps(root):
            if step > start_step:
                shutil.rmtree(step_dir(root, step))

    async def write(
        self,
        step: int,
        number: int,
        version: int,
        groups: tuple[Group, ...],
        metadata: Mapping[str, Any],
        trained: TrainBatch | None,
    ) -> float:
        """Store one step's batch; the seconds it took (the step's `time/save_batch_s`)."""
        started = time.monotonic()
        stored = StoredBatch(
            step=step,
            number=number,
            version=version,
            groups=groups,
            metadata=dict(metadata),
            shape=self.shape,
            trained=trained,
        )
        await trio.to_thread.run_sync(write_batch, self.root, stored)
        return time.monotonic() - started


def batches_root(run_dir: str | os.PathLike[str]) -> Path:
    """Where a run keeps its batches."""
    return Path(run_dir) / BATCHES_DIR


def batch_writer(config: Config, run_dir: Path, start_step: int) -> BatchWriter | None:
    """The writer of a run's trained batches when `logging.save_batches` asks for one."""
    if not config.logging.save_batches:
        return None
    return BatchWriter(batches_root(run_dir), config, start_step)
