"""The weight-update process group a trainer shares with its engines, on SGLang's wire.

SGLang's `/init_weights_update_group` makes each engine join a torch.distributed group of its own
(not its default group): a `tcp://master_address:master_port` rendezvous whose store is prefixed
with the group name, the trainer at rank 0, engine ranks from `rank_offset`. Weights then travel
as broadcasts from rank 0: one per tensor of the bucket, in the order of the HTTP request's names
(`load_format` null), or, with `load_format = "flattened_bucket"`, one broadcast of the bucket's
tensors' raw bytes concatenated in order (uint8); the receiver builds the tensors from the names,
dtypes and shapes of the request. The trainer and the built-in engine both use this module, so
the bytes on the wire are the same as with a real SGLang server.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

import torch
import torch.distributed as dist

GroupBackend = Literal["gloo", "nccl"]  # the process group's torch.distributed backend
GROUP_BACKENDS: tuple[GroupBackend, ...] = get_args(GroupBackend)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One tensor of a bucket as the HTTP request names it (SGLang: names, dtypes, shapes)."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.dtype in DTYPES, f"{self.name}: dtype {self.dtype!r} not in {list(DTYPES)}"
        assert all(d >= 0 for d in self.shape), f"{self.name}: bad shape {self.shape}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the form SGLang and vLLM take in their requests)."""
    name = str(dtype).removeprefix("torch.")
    assert name in DTYPES, f"{dtype} cannot be sent: not in {list(DTYPES)}"
    return name


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The wire description of `tensor` under `name`."""
    return TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """Split tensors, in order, into buckets of at most `bucket_bytes` (a bigger tensor is alone).

    Pure: the trainer plans once per sync; every bucket is one HTTP call and one broadcast.
    """
    assert bucket_bytes >= 1, f"{bucket_bytes=}"
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(tuple(current))
    assert sum(len(b) for b in buckets) == len(specs), f"{len(specs)=} lost in bucketing"
    return buckets


def flatten(tensors: Iterable[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw bytes of `tensors`, concatenated in order, as one uint8 tensor: a new one, or the
    front of `out` (a reused uint8 buffer, on any device: each tensor is copied into its slice)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    assert parts, "an empty bucket"
    total = sum(p.numel() for p in parts)
    if out is None:
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    assert out.dtype == torch.uint8 and out.numel() >= total, f"{out.shape=} < {total=} bytes"
    flat, start = out[:total], 0
    for part in parts:
        flat[start : start + part.numel()].copy_(part)
        start += part.numel()
    return flat


class BucketBuffer:
    """One uint8 buffer reused for every bucket (grown to the largest): buckets land in memory
    that is already mapped, and at most one bucket's bytes are held on the device."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of `nbytes` bytes (its contents are whatever was there)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one before the bigger one is made
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    def release(self) -> None:
        self._buffer = None


def unflatten(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` as the bucket's tensors (the inverse of `flatten`)."""
    assert flat.dtype == torch.uint8, f"{flat.dtype=}"
    total = sum(s.nbytes for s in specs)
    assert flat.numel() == total, f"{flat.numel()=} != {total=} bytes of {len(specs)} tensors"
    out, start = [], 0
    for s in specs:
        chunk = flat[start : start + s.nbytes]
        out.append((s.name, chunk.view(DTYPES[s.dtype]).reshape(s.shape)))
        start += s.nbytes
    return out


def bucket_bytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of one flattened bucket."""
    return sum(s.nbytes for s in specs)


def specs_from_request(names: object, dtypes: object, shapes: object) -> list[TensorSpec]:
    """names/dtypes/shapes of an HTTP request -> specs; ValueError (naming the field) if bad."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    specs = []
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        d = str(d).removeprefix("torch.")
        if d not in DTYPES:
            raise ValueError(f"dtypes: {d!r} ({n}) is not one of {list(DTYPES)}")
        if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise ValueError(f"shapes: {s!r} ({n}) is not a list of sizes")
        specs.append(TensorSpec(name=str(n), dtype=d, shape=tuple(s)))
    return specs


def init_custom_group(
    *,
    backend: GroupBackend,
    address: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join a process group apart from the default one (SGLang's `init_custom_process_group`).

    Rank 0 hosts the TCP store at address:port. Blocks until all `world_size` ranks joined (or
    `timeout_s`). Works with or without a default process group in this process.
    """
    from torch.distributed import distributed_c10d as c10d

    assert 0 <= rank < world_size, f"{rank=} not in [0, {world_size=})"
    assert backend in GROUP_BACKENDS, f"{backend=} not in {GROUP_BACKENDS}"
    timeout = datetime.timedelta(seconds=timeout_s)
    # what SGLang's `tcp://` rendezvous makes, built directly: under torchrun, rendezvous() would
    # join torchrun's own agent store instead of hosting this one on rank 0
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout, multi_tenant=True)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **options,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Leave a group made by `init_custom_group` (a no-op for None)."""
    if group is not None:
        dist.destroy_process_group(group)


def broadcast_bucket(group: dist.ProcessGroup, flat: torch.Tensor) -> None:
    """Broadcast one flattened bucket from rank 0 (send on rank 0, receive in place elsewhere).

    Blocking: waits until the bytes are sent or received (on CUDA, until the stream finished).
    """
    dist.broadcast(flat, src=0, group=group)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()


def state_specs(weights: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Specs of a state dict, in its order."""
    return [spec_of(name, t) for name, t in weights.items()]
