"""The training backend in its own process: the driver's Python never holds the trainer's GIL.

In async mode the trio driver (HTTP to the engines, rewards, batch building) works while the
training step runs. In one process both need the one GIL: the training thread gives it up around
every torch op and must take it back, and while the driver runs Python on its own core the
training thread waits. `TrainerProcess` starts one child process (`python -m
rollouts.trainer.process_child`, so nothing of the caller's `__main__` is re-run) that
builds one-device backends (the policy, a reference model) with `create_pytorch_backend` and runs
their calls. `ProcessBackend` is the driver's handle: a `TrainingBackend` whose calls are pickled
over a socket pair in order (`process_wire.py`) and whose results come back as `TrainFuture`s.

Start-up is not waited for: the child imports torch and builds the model while the driver starts
the engines, and an error of that work comes back from the next call. In the child, calls that
return a future are only submitted (the backend's training thread runs them in order) and the
reply is sent when it finishes; weight files of a snapshot are written on a separate writer
thread, beside the next step. The child's torch RNG goes into the checkpoint (`rng_trainer.pt`).
If the child dies, every pending and later call fails with `TrainerProcessError`, which names its
pid and exit code. The child ends when the driver closes it, or by itself when the driver's end
of the socket closes (the driver died).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rollouts.config import Config
from rollouts.trainer.process_wire import HOST, dumps, pack, unpack
from rollouts.types import LossFn, TrainBatch, TrainFuture

CLOSE_TIMEOUT_S = 30.0


class TrainerProcessError(RuntimeError):
    """The trainer process died (or could not start); its calls cannot finish."""


@dataclasses.dataclass(frozen=True, slots=True)
class WeightSnapshot:
    """Weights copied in the trainer process (by `snapshot_weights`), kept there until written."""

    key: int


class TrainerProcess:
    """One child process hosting one-device backends; `create` has `create_backend`'s signature."""

    def __init__(self, *, threads: int, other_cores: Collection[int] = ()) -> None:
        """Start the child with `threads` torch threads; its threads other than the training
        threads (the socket reader, the weight writer) run on `other_cores` (() = anywhere)."""
        assert threads >= 1, f"{threads=}"
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "rollouts.trainer.process_child", str(fd)],
            pass_fds=(fd,),
        )
        theirs.close()
        self.pid = self._process.pid
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()  # one message at a time, ids in sending order
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._error: TrainerProcessError | None = None
        self._backend_ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="trainer-reader", daemon=True)
        self._reader.start()
        # not waited for: the child imports torch and transformers while the caller goes on
        # (starts the engines); a failure comes back from the next call that waits
        self._unchecked: list[concurrent.futures.Future[Any]] = []
        self.call_unchecked(HOST, "init", list(sys.path), threads, tuple(other_cores))

    def call(self, target: int, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Send one call to the child; its future completes when the child answers."""
        return self.send(target, name, args, kwargs)

    def send(
        self, target: int, name: str, args: tuple, kwargs: dict, *, check: bool = True
    ) -> concurrent.futures.Future:
        """`call`; with `check` (not when closing) it first raises the error of a failed call
        nobody waited for."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                raise self._error
            if check:
                self._raise_unchecked()
            call_id = next(self._ids)
            payload = dumps(name, (target, name, tuple(map(pack, args)), kwargs))
            self._pending[call_id] = future
            try:
                self._conn.send_bytes(call_id.to_bytes(8, "little") + payload)
            except (OSError, EOFError) as e:
                self._pending.pop(call_id, None)
                raise self._died(f"sending {name!r} failed ({e})") from e
        return future

    def call_unchecked(self, target: int, name: str, *args: Any, **kwargs: Any) -> None:
        """A call nobody waits for (start-up work); its error comes back from the next call."""
        future = self.call(target, name, *args, **kwargs)
        with self._lock:
            self._unchecked.append(future)

    def _raise_unchecked(self) -> None:
        """The error of an unchecked call that failed (holding the lock)."""
        failed = [f for f in self._unchecked if f.done() and f.exception() is not None]
        self._unchecked = [f for f in self._unchecked if not f.done()]
        if failed:
            raise failed[0].exception()

    def _read(self) -> None:
        """The reader thread: complete each answered call's future; on EOF, fail them all."""
        while True:
            try:
                call_id, ok, value, where = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(call_id)
            if ok:
                future.set_result(unpack(value))
            else:
                if where:
                    value.add_note(f"in the trainer process (pid {self.pid}):\n{where}")
                future.set_exception(value)
        with self._lock:
            error = self._died("it closed its end of the socket")
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(error)

    def _died(self, how: str) -> TrainerProcessError:
        if self._error is None:
            try:
                code = self._process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
            self._error = TrainerProcessError(
                f"the trainer process (pid {self.pid}) is gone: {how}; exit code {code} "
                "(a negative code is the signal that killed it; see its output above)"
            )
        return self._error

    def create(self, config: Config, **kwargs: Any) -> ProcessBackend:
        """A one-device backend for `config` built in the child (`create_pytorch_backend`);
        returns at once (the child builds it in order before the backend's first call)."""
        backend_id = next(self._backend_ids)
        self.call_unchecked(backend_id, "create", config, **kwargs)
        return ProcessBackend(self, backend_id, adapters=config.model.lora.enabled)

    def close(self) -> None:
        """Stop the child (its backends finish their queued work first); kill it if it hangs."""
        if self._error is None and self._process.poll() is None:
            with contextlib.suppress(TrainerProcessError, concurrent.futures.TimeoutError):
                self.send(HOST, "exit", (), {}, check=False).result(timeout=CLOSE_TIMEOUT_S)
        try:
            self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)


class ProcessBackend:
    """The driver's handle on a backend in the trainer process; see `TrainingBackend`."""

    rank = 0
    world_size = 1

    def __init__(self, host: TrainerProcess, backend_id: int, *, adapters: bool = False) -> None:
        self.host = host
        self.backend_id = backend_id
        self.adapters = adapters  # built with model.lora.enabled (the child's backend trains LoRA)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> TrainFuture[Any]:
        return TrainFuture(self.host.call(self.backend_id, name, *args, **kwargs))

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

    def snapshot_weights(self) -> WeightSnapshot:
        """Copy this step's weights in the trainer process (in order after the submitted work);
        `write_weights` writes them there, so they never cross the socket."""
        return WeightSnapshot(self._call("snapshot_weights").result())

    def write_weights(self, snapshot: WeightSnapshot, path: Path) -> None:
        """Write a snapshot's weight files (on the child's writer thread; the training thread
        goes on with the next step)."""
        assert isinstance(snapshot, WeightSnapshot), f"{type(snapshot)=}"
        self._call("write_weights", snapshot.key, Path(path)).result()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._call("load_weights", dict(weights)).result()

    def save_checkpoint(self, path: Path) -> TrainFuture[None]:
        return self._call("save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> TrainFuture[None]:
        return self._call("load_checkpoint", Path(path))

    def save_weights(self, path: Path) -> TrainFuture[None]:
        return self._call("save_weights", Path(path))

    def pin_thread(self, cores: Collection[int]) -> None:
        """Run the child's training thread (and the torch threads it starts) on `cores` (not
        waited for: it runs before the backend's next call)."""
        self.host.call_unchecked(self.backend_id, "pin_thread", tuple(cores))

    def weight_snapshots(self) -> ProcessBackend:
        """This backend: it takes snapshots (`snapshot_weights`, `write_weights`)."""
        return self

    def lora_adapters(self) -> ProcessBackend | None:
        """This backend when the child's trains LoRA adapters."""
        return self if self.adapters else None

    def save_adapter(self, path: Path) -> TrainFuture[int]:
        return self._call("save_adapter", Path(path))

    def save_base_weights(self, path: Path) -> TrainFuture[None]:
        return self._call("save_base_weights", Path(path))

    def compute_base_logprobs(self, batch: TrainBatch) -> TrainFuture[tuple[torch.Tensor, ...]]:
        return self._call("compute_base_logprobs", batch)

    def barrier(self) -> None:
        """One device: nothing to wait for."""
        return None

    def close(self) -> None:
        """Finish this backend's queued work and stop its training thread (the process stays;
        a dead one has nothing left to stop)."""
        with contextlib.suppress(TrainerProcessError):
            self.host.send(self.backend_id, "close", (), {}, check=False).result()
