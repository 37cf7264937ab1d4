"""Drive FSDP backends from one process: rank 0 runs the loops, the other ranks mirror its calls.

Under `torchrun --nproc_per_node N`, only rank 0 runs the trio driver (engines, rollouts,
metrics). Every backend call it makes is first broadcast - (backend id, method, arguments) - on
a dedicated gloo group, then run locally; ranks 1..N-1 run `BackendHub.follow()`, which receives
the same calls in the same order and runs them on their own shard, so the FSDP collectives match
across ranks. All of rank 0's calls go through one control thread, so a control broadcast never
interleaves with the backend's own collectives. Functions that "every rank calls"
(`save_checkpoint`, `publish_weights`) work unchanged on a `MirroredBackend`: their backend
calls (barrier, save) are mirrored one by one.

Across nodes, paths go out absolute (each node's torchrun may have its own working directory),
and `check_shared` proves at start that every rank sees rank 0's checkpoint directory: rank 0
writes the model files there and every rank its DCP shard, so a node-local path would leave
checkpoints that no node can resume.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollouts.config import Config
from rollouts.types import LossFn, TrainBatch, TrainFuture

EXIT = "exit"
SHARED_WAIT_S = 10.0  # how long a rank looks for rank 0's marker (a network filesystem's lag)


class SharedPathError(RuntimeError):
    """A rank cannot see rank 0's checkpoint directory: checkpoints would be torn across nodes."""


class BackendHub:
    """The per-process registry of mirrored backends and the control channel."""

    def __init__(self) -> None:
        from rollouts.trainer.dist import init_distributed

        init_distributed()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._group = dist.new_group(backend="gloo")
        self._backends: dict[int, Any] = {}
        self._next_id = 0
        self._control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mirror")

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _execute(self, message: tuple) -> Any:
        """Run one control message on this rank (the same on every rank)."""
        kind = message[0]
        if kind == "create":
            _, backend_id, config, kwargs = message
            from rollouts.trainer.fsdp import create_fsdp_backend

            self._backends[backend_id] = create_fsdp_backend(config, **kwargs)
            return self._backends[backend_id]
        if kind == "shared":
            seen = (socket.gethostname(), _appears(Path(message[1]), SHARED_WAIT_S))
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, seen, group=self._group)
            return everyone
        if kind == "release":
            self._backends.pop(message[1]).release()
            return None
        assert kind == "call", f"unknown control message {kind!r}"
        _, backend_id, name, args, kwargs = message
        result = getattr(self._backends[backend_id], name)(*args, **kwargs)
        return result.result() if isinstance(result, TrainFuture) else result

    def _lead(self, message: tuple) -> Any:
        """Rank 0, on the control thread: tell the followers, then do the same."""
        assert self.rank == 0, "only rank 0 leads"
        self._broadcast(message)
        return self._execute(message)

    def submit(self, message: tuple) -> concurrent.futures.Future:
        return self._control.submit(self._lead, message)

    def create(self, config: Config, **kwargs: Any) -> MirroredBackend:
        """Build an FSDP backend on every rank; the handle rank 0's driver uses."""
        backend_id = self._next_id
        self._next_id += 1
        kwargs = {k: Path(v).absolute() if isinstance(v, Path) else v for k, v in kwargs.items()}
        self.submit(("create", backend_id, config, kwargs)).result()
        return MirroredBackend(self, backend_id)

    def check_shared(self, root: Path) -> None:
        """Rank 0: SharedPathError unless every rank sees `root` (created here), naming the
        ranks and hosts that do not and the fix. Rank 0 writes a marker; each rank looks."""
        root = Path(root).absolute()
        root.mkdir(parents=True, exist_ok=True)
        marker = root / f".shared-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        marker.write_text("rank 0 wrote this; every rank must see it\n")
        try:
            seen = self.submit(("shared", str(marker))).result()
        finally:
            marker.unlink(missing_ok=True)
        problem = unshared_problem(root, seen)
        if problem:
            raise SharedPathError(problem)

    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's calls until it says exit."""
        assert self.rank != 0, "rank 0 leads; it does not follow"
        while True:
            message = self._broadcast(None)
            if message[0] == EXIT:
                break
            self._execute(message)
        self._finish()

    def shutdown(self) -> None:
        """Rank 0: release the followers, then leave the process group."""
        self._control.submit(self._broadcast, (EXIT,)).result()
        self._control.shutdown(wait=True)
        self._finish()

    def _finish(self) -> None:
        for backend in self._backends.values():
            backend.release()
        self._backends.clear()
        dist.barrier()
        dist.destroy_process_group()


def unshared_problem(root: Path, seen: list[tuple[str, bool]]) -> str:
    """Why checkpoints under `root` would be torn ('' when every rank saw rank 0's marker):
    `seen[rank]` is (its host, whether it saw the marker)."""
    blind = [f"rank {rank} on {host}" for rank, (host, ok) in enumerate(seen) if not ok]
    if not blind:
        return ""
    return (
        f"the checkpoint directory {root} is not shared: {', '.join(blind)} cannot see what "
        f"rank 0 on {seen[0][0]} wrote there (looked for {SHARED_WAIT_S:.0f} s). Every node "
        "writes its shard of each checkpoint there: set run.output_dir (or checkpoint.dir) to a "
        "path on a filesystem all nodes mount at the same place"
    )


def _appears(path: Path, wait_s: float) -> bool:
    """Whether `path` exists, looking again for up to `wait_s` (bounded)."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class MirroredBackend:
    """A `TrainingBackend` on rank 0 whose every call is mirrored on all ranks."""

    def __init__(self, hub: BackendHub, backend_id: int) -> None:
        self.hub = hub
        self.backend_id = backend_id
        self.rank = 0
        self.world_size = hub.world_size
        self.tokenizer = hub._backends[backend_id].tokenizer
        self.adapters = hub._backends[backend_id].adapters  # it trains LoRA adapters

    def _call(self, name: str, *args: Any, **kwargs: Any) -> TrainFuture[Any]:
        return TrainFuture(self.hub.submit(("call", self.backend_id, name, args, kwargs)))

    def forward_backward(
        self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False, values: bool = False
    ) -> TrainFuture[dict[str, float]]:
        return self._call("forward_backward", batch, loss_fn, entropy=entropy, values=values)

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        return self._call("optim_step")

    def compute_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        return self._call("compute_logprobs", batch)

    def compute_values(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        return self._call("compute_values", batch)

    def get_weights(self) -> dict[str, torch.Tensor]:
        return self._call("get_weights").result()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._call("load_weights", dict(weights)).result()

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        return self._call("save_checkpoint", Path(path).absolute())

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        return self._call("load_checkpoint", Path(path).absolute())

    def save_weights(self, path: Path) -> TrainFuture[None]:
        return self._call("save_weights", Path(path).absolute())

    def weight_snapshots(self) -> None:
        """No snapshots: weights are gathered and written when published."""
        return None

    def lora_adapters(self) -> MirroredBackend | None:
        """This handle when the backend trains LoRA adapters (its calls mirrored too)."""
        return self if self.adapters else None

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        return self._call("save_adapter", Path(path))

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        return self._call("save_base_weights", Path(path))

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        return self._call("compute_base_logprobs", batch)

    def pin_thread(self, cores: Collection[int]) -> None:
        """Nothing to pin: torchrun places the ranks."""
        return None

    def barrier(self) -> None:
        self._call("barrier").result()

    def close(self) -> None:
        """Stop this backend's worker on every rank (the process group stays for the next)."""
        self.hub.submit(("release", self.backend_id)).result()
