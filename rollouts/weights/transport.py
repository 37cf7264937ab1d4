"""The trainer's end of a weight-update group: join it as rank 0, broadcast buckets, leave.

Two wires, one per engine family (`WeightReceiver.weight_wire`):
- "sglang": a torch.distributed group made like SGLang makes it (`weight_group.init_custom_group`),
  gloo on CPU or NCCL on CUDA; a bucket's tensors are broadcast one by one, issued together
  (SGLang's default format, which every 0.5.x server reads; measured faster on CPU than one
  flattened broadcast, which costs a copy of the bucket on each side).
  SGLang and the built-in engine server receive it.
- "vllm": vLLM's own NCCL communicator (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`,
  imported from the installed vllm: its rendezvous is vLLM's, not torch's); tensors are
  broadcast one by one, the unpacked format every vLLM from 0.27 to 0.33 reads.
Every method blocks: the sync runs them with `trio.to_thread.run_sync`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rollouts.inference.protocol import WeightGroupSpec
from rollouts.wire.weight_group import destroy_group, init_custom_group


class Transport(Protocol):
    """Rank 0 of a weight-update group."""

    def join(self, spec: WeightGroupSpec, timeout_s: float) -> None:
        """Form the group (blocks until every engine rank joined or `timeout_s`)."""
        ...

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast one bucket (blocks until sent)."""
        ...

    def close(self) -> None:
        """Leave the group (best effort)."""
        ...


class TorchGroupTransport:
    """SGLang's wire: a custom torch.distributed group, the bucket's tensors broadcast in order."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = _indexed(device)
        self.group: Any = None

    def join(self, spec: WeightGroupSpec, timeout_s: float) -> None:
        """Host the rendezvous store and join as rank 0."""
        assert self.group is None, "already in a group; close it first"
        if spec.backend == "nccl":
            assert self.device.type == "cuda", f"nccl needs a CUDA device, not {self.device}"
            torch.cuda.set_device(self.device)
        self.group = init_custom_group(
            backend=spec.backend,
            address=spec.master_address,
            port=spec.master_port,
            world_size=spec.world_size,
            rank=0,
            group_name=spec.group_name,
            timeout_s=timeout_s,
        )

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast the bucket's tensors one by one, in order (SGLang's default format: every
        0.5.x server reads it); issued together, waited for together."""
        assert self.group is not None, "join the group first"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this worker thread's current device
        sent = [t.detach().to(self.device).contiguous() for t in tensors]
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in sent]
        for work in works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        group, self.group = self.group, None
        destroy_group(group)


class VLLMNcclTransport:
    """vLLM's wire: vLLM's NCCL communicator from the installed vllm, tensor by tensor."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        assert self.device.type == "cuda", (
            f"vLLM's weight transfer is NCCL: needs CUDA, not {device}"
        )
        self.comm: Any = None

    def join(self, spec: WeightGroupSpec, timeout_s: float) -> None:
        """vLLM's `trainer_init` (rank 0 of a StatelessProcessGroup + PyNcclCommunicator)."""
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise RuntimeError(
                "weight_sync.method = 'distributed' with vLLM engines needs vllm importable in "
                f"the trainer (pip install 'rollouts[vllm]'): {exc}"
            ) from exc
        torch.cuda.set_device(self.device)
        info = {
            "master_address": spec.master_address,
            "master_port": spec.master_port,
            "world_size": spec.world_size,
        }
        self.comm = trainer_init(info)

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """One NCCL broadcast per tensor, in the order of the bucket's names."""
        assert self.comm is not None, "join the group first"
        torch.cuda.set_device(self.device)  # this worker thread's current device
        stream = torch.cuda.current_stream(self.device)
        for tensor in tensors:
            self.comm.broadcast(tensor.to(self.device).contiguous(), src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        comm, self.comm = self.comm, None
        destroy = getattr(comm, "destroy", None)
        if destroy is not None:
            destroy()


def _indexed(device: str | torch.device) -> torch.device:
    """ "cuda" -> "cuda:<current device>" (a broadcast needs one definite device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_transport(wire: str, device: str | torch.device) -> Transport:
    """The transport for an engine family's wire ("sglang" | "vllm")."""
    if wire == "sglang":
        return TorchGroupTransport(device)
    if wire == "vllm":
        return VLLMNcclTransport(device)
    raise ValueError(f"unknown weight wire {wire!r}: expected 'sglang' or 'vllm'")
