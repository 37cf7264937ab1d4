"""The built-in server's end of SGLang's distributed weight update (gloo on CPU, NCCL on CUDA).

`/init_weights_update_group` joins the trainer's group (`weight_group.init_custom_group`) in a
thread; `/update_weights_from_distributed` receives one bucket in a thread, into fresh buffers,
without blocking the event loop, then hands the tensors to the worker as a command, so they are
copied into the model between two decode steps (at once when paused, else once the running
requests finished, like SGLang). As in SGLang >= 0.5.21, updates run inside a session opened by
`/begin_weight_update` and closed by `/end_weight_update`. The bucket is always received, even
when it will be refused, so that the trainer's broadcast never waits for a receiver that left.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import trio

from rollouts.engine.state import ServerState
from rollouts.wire.weight_group import (
    BucketBuffer,
    TensorSpec,
    broadcast_bucket,
    bucket_bytes,
    destroy_group,
    init_custom_group,
    unflatten,
)

GROUP_TIMEOUT_S = 300.0  # joining the group, and each collective on it
LOAD_FORMATS = (None, "flattened_bucket")


class UpdateRefused(ValueError):
    """The update cannot run (no group, no session, bad tensors): success false, HTTP 400."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupRequest:
    """A validated /init_weights_update_group body."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise UpdateRefused(f"backend {self.backend!r}: the built-in server has gloo and nccl")
        if not 0 < self.rank_offset < self.world_size:
            raise UpdateRefused(f"rank_offset {self.rank_offset} not in [1, {self.world_size})")


def receive_bucket(
    group: Any, specs: Sequence[TensorSpec], buffer: BucketBuffer, flattened: bool
) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast from rank 0 into the reused buffer (the tensors returned are
    views of it): one flat uint8 broadcast ("flattened_bucket"), or one per tensor, issued
    together and waited for together (SGLang's default format)."""
    flat = buffer.take(bucket_bytes(specs))
    tensors = unflatten(flat, specs)
    if flattened:
        broadcast_bucket(group, flat)
        return tensors
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in tensors]
    for work in works:
        work.wait()
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    return tensors


@torch.no_grad()
def apply_tensors(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy received tensors into the model's parameters and buffers, by HF name.

    Checks every name and shape before copying anything: a refused bucket changes nothing.
    """
    own = model.state_dict()
    unknown = [name for name, _ in tensors if name not in own]
    if unknown:
        raise UpdateRefused(f"names not in the served model: {unknown[:5]}")
    for name, tensor in tensors:
        if own[name].shape != tensor.shape:
            served = tuple(own[name].shape)
            raise UpdateRefused(f"{name}: shape {tuple(tensor.shape)}, the model has {served}")
    for name, tensor in tensors:
        own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))


class DistWeights:
    """The weight-update group and session of one server (used only from the trio thread)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.device = next(state.core.model.parameters()).device
        self.groups: dict[str, tuple[Any, str]] = {}  # name -> (process group, backend)
        self.buffers: dict[str, BucketBuffer] = {}  # per backend: "cpu" (gloo) or the device
        self.session = False
        self._lock = trio.Lock()  # one collective at a time

    async def init_group(self, req: GroupRequest) -> None:
        """Join the trainer's group; returns once every rank joined (or raises)."""
        if req.backend == "nccl" and self.device.type != "cuda":
            raise UpdateRefused("backend nccl needs the server on a CUDA device (--device cuda)")
        async with self._lock:
            old = self.groups.pop(req.group_name, None)
            if old is not None:
                await trio.to_thread.run_sync(destroy_group, old[0])
            join = functools.partial(
                init_custom_group,
                backend=req.backend,
                address=req.master_address,
                port=req.master_port,
                world_size=req.world_size,
                rank=req.rank_offset,
                group_name=req.group_name,
                timeout_s=GROUP_TIMEOUT_S,
            )
            group = await _in_thread(join, self.device)
            self.groups[req.group_name] = (group, req.backend)

    async def destroy_group(self, group_name: str) -> None:
        """Leave a group; UpdateRefused when there is none of that name."""
        async with self._lock:
            if group_name not in self.groups:
                raise UpdateRefused("The group to be destroyed does not exist.")
            group, _ = self.groups.pop(group_name)
            await trio.to_thread.run_sync(destroy_group, group)
            if not self.groups:
                self.buffers.clear()

    def begin(self) -> None:
        if self.session:
            raise UpdateRefused("a weight-update session is already open; end it first")
        self.session = True

    def end(self) -> None:
        if not self.session:
            raise UpdateRefused("no weight-update session is open; begin one first")
        self.session = False

    async def update(
        self,
        specs: Sequence[TensorSpec],
        *,
        group_name: str,
        load_format: str | None,
        version: str | None,
        flush_cache: bool,
    ) -> None:
        """Receive one bucket, then load it in the worker between steps; set the version."""
        if group_name not in self.groups:
            raise UpdateRefused(f"group {group_name!r} not in {list(self.groups)}; init it first")
        if load_format not in LOAD_FORMATS:
            raise UpdateRefused(f"load_format {load_format!r} not in {list(LOAD_FORMATS)}")
        group, backend = self.groups[group_name]
        if backend not in self.buffers:
            self.buffers[backend] = BucketBuffer(self.device if backend == "nccl" else "cpu")
        flat = load_format == "flattened_bucket"
        async with self._lock:  # held until loaded: the next bucket reuses the buffer
            receive = functools.partial(receive_bucket, group, specs, self.buffers[backend], flat)
            tensors = await _in_thread(receive, self.device)
            if not self.session:  # received, so the trainer is not left waiting; not loaded
                raise UpdateRefused(
                    "update_weights_from_distributed must run between begin_weight_update and "
                    "end_weight_update"
                )
            await self.state.command(self._loader(tensors, version, flush_cache))

    def _loader(
        self, tensors: list[tuple[str, torch.Tensor]], version: str | None, flush_cache: bool
    ) -> Callable[[Callable[[Any], None]], None]:
        core = self.state.core

        def run(reply: Callable[[Any], None]) -> None:
            def load() -> None:
                try:
                    apply_tensors(core.model, tensors)
                except UpdateRefused as exc:
                    reply(exc)
                    return
                core.weights_changed()
                running, _ = core.load()
                if flush_cache and self.state.sglang_pause == "in_place" and running:
                    reply(
                        UpdateRefused(
                            f"Cache not flushed: {running} running requests under an "
                            "in_place pause (pause with mode retract to flush)"
                        )
                    )
                    return
                if version is not None:
                    core.set_version(version)  # running rows (keep pause) note where it starts
                reply(None)

            if core.paused:
                load()
            else:
                core.when_idle(load)

        return run


async def _in_thread(fn: Callable[[], Any], device: torch.device) -> Any:
    """Blocking collective work in a thread (with the CUDA device set), bounded in time."""

    def work() -> Any:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return fn()

    with trio.fail_after(GROUP_TIMEOUT_S + 10.0):
        return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
