"""The weight files an engine reloads, written straight from the tensors.

`save_pretrained` serialises through safetensors' `save_file`, which builds the whole file in one
buffer before writing it: for a sync that is a full copy of the model (after the CPU copy the
caller already made) and a fresh allocation of its size every step. `write_engine_files` writes the
same format (safetensors with `{"format": "pt"}` metadata, sharded with an index past
`max_shard_bytes`, plus config.json, generation_config.json and the tokenizer) tensor by tensor
from the tensors it is given, live parameters included: each tensor is cast (when `dtype` is
given) and moved to the CPU on its own, so the extra memory is one tensor, not a model. Files of
a directory written before are rewritten in place (`files.publish_weights` recycles the version it
would prune), and files of another layout removed.
On SmolLM2-135M in a trainer process, `scripts/bench_weight_write.py` times both.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
MAX_SHARD_BYTES = 5 * 1024**3  # save_pretrained's shard size before transformers 5
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _as_written(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` as it goes into the file: detached, cast when floating and `dtype` is given, on the
    CPU, contiguous (no copy where it already is all of these)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    cast = dtype is not None and t.is_floating_point()
    return t.numel() * (torch.empty((), dtype=dtype).element_size() if cast else t.element_size())


def _shards(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype | None, max_bytes: int
) -> list[list[str]]:
    """Tensor names in file order, cut into shards of at most `max_bytes` (a bigger tensor gets
    a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in state:
        n = _nbytes(state[name], dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(
    state: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype | None
) -> bytes:
    """The safetensors header of `names`: 8-byte length, then JSON padded to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = state[name]
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if out_dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {out_dtype} has no safetensors name")
        n = _nbytes(t, dtype)
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[out_dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    state: Mapping[str, torch.Tensor], names: list[str], file: Path, dtype: torch.dtype | None
) -> None:
    """One safetensors file of `names`, each tensor's bytes written from its own memory. An
    existing `file` is rewritten in place (its pages reused), then cut to the new length."""
    with file.open("r+b" if file.is_file() else "wb") as f:
        f.write(_header(state, names, dtype))
        for name in names:
            t = _as_written(state[name], dtype)
            if t.numel():
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
        f.truncate()


def _shard_files(count: int) -> Iterator[str]:
    for i in range(count):
        yield SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_engine_files(
    lm: Any,
    tokenizer: Any,
    path: Path,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """HF-format files in `path` (created) that transformers, vLLM, SGLang and the built-in
    engine load: `state` as safetensors (floating tensors in `dtype` when given), `lm`'s config
    and generation config, and the tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    shards = _shards(state, dtype, max_shard_bytes)
    files = list(_shard_files(len(shards)))
    stale = [*path.glob("*.safetensors"), path / INDEX_FILE]  # a directory written before
    for old in stale:
        if old.name not in files:
            old.unlink(missing_ok=True)
    for names, file in zip(shards, files, strict=True):
        write_safetensors(state, names, path / file, dtype)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t, dtype) for t in state.values())},
            "weight_map": {
                n: file for names, file in zip(shards, files, strict=True) for n in names
            },
        }
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    lm.config.save_pretrained(path)  # the model's dtype, as save_pretrained writes it
    generation = getattr(lm, "generation_config", None)
    if generation is not None and getattr(lm, "can_generate", lambda: False)():
        generation.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
