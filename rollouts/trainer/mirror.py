"""Drive FSDP backends from one process: rank 0 runs the loops, the other ranks mirror its calls.

Under `torchrun --nproc_per_node N`, only rank 0 runs the trio driver (engines, rollouts,
metrics). Every backend call it makes is first broadcast - (backend id, method, arguments) - on
a dedicated gloo group, then run locally; ranks 1..N-1 run `BackendHub.follow()`, which receives
the same calls in the same order and runs them on their own shard, so the FSDP collectives match
across ranks. All of rank 0's calls go through one control thread, so a control broadcast never
interleaves with the backend's own collectives. Rank 0's handle is a `RemoteBackend`
(`remote.py`) over a `MirrorLink`. Functions that "every rank calls" (`save_checkpoint`,
`publish_weights`) work unchanged on it: their backend calls (barrier, save) are mirrored one
by one.

Across nodes, paths go out absolute (each node's torchrun may have its own working directory),
and `check_shared` proves at start that every rank sees rank 0's checkpoint directory: rank 0
writes the model files there and every rank its DCP shard, so a node-local path would leave
checkpoints that no node can resume.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rollouts.config import Config
from rollouts.trainer.remote import RemoteBackend
from rollouts.types import TrainFuture

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

    def create(self, config: Config, **kwargs: Any) -> RemoteBackend:
        """Build an FSDP backend on every rank; the handle rank 0's driver uses (no weight
        snapshots: FSDP gathers and writes the weights when they are published)."""
        backend_id = self._next_id
        self._next_id += 1
        kwargs = {k: Path(v).absolute() if isinstance(v, Path) else v for k, v in kwargs.items()}
        self.submit(("create", backend_id, config, kwargs)).result()
        link = MirrorLink(self, backend_id)
        lora = config.model.lora.enabled
        return RemoteBackend(link, world_size=self.world_size, adapters=lora, snapshots=False)

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


@dataclasses.dataclass(frozen=True, slots=True)
class MirrorLink:
    """The `BackendLink` to one mirrored backend: each call broadcast, then run on every rank."""

    hub: BackendHub
    backend_id: int

    def call(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """The backend's method `name` on every rank, in order (rank 0's result)."""
        return self.hub.submit(("call", self.backend_id, name, args, kwargs))

    def pin_thread(self, cores: tuple[int, ...]) -> None:
        """Nothing to pin: torchrun places the ranks."""
        return None

    def barrier(self) -> None:
        """Every rank's backend waits for the others (a mirrored call)."""
        self.call("barrier").result()

    def close(self) -> None:
        """Stop this backend's worker on every rank (the process group stays for the next)."""
        self.hub.submit(("release", self.backend_id)).result()
