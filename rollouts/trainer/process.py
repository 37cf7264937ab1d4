"""The training backend in its own process: the driver's Python never holds the trainer's GIL.

In async mode the trio driver (HTTP to the engines, rewards, batch building) works while the
training step runs. In one process both need the one GIL: the training thread gives it up around
every torch op and must take it back, and while the driver runs Python on its own core the
training thread waits. `TrainerProcess` starts one child process (`python -m
rollouts.trainer.process_child`, so nothing of the caller's `__main__` is re-run) that
builds one-device backends (the policy, a reference model) with `create_pytorch_backend` and runs
their calls. The driver's handle is a `RemoteBackend` (`remote.py`) over a `ProcessLink`: its
calls are pickled over a socket pair in order (`process_wire.py`) and come back as `TrainFuture`s.

Where `$ROLLOUTS_FORKSERVER` names a forkserver (`rollouts/forkserver/`; the test suite starts
one), the child is forked from there: the same program without its seconds of imports.

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
from collections.abc import Collection
from multiprocessing.connection import Connection
from typing import Any

from rollouts import tracing
from rollouts.config import Config
from rollouts.forkserver import ForkedProcess, fork
from rollouts.trainer.process_wire import HOST, dumps, pack, unpack
from rollouts.trainer.remote import RemoteBackend

CLOSE_TIMEOUT_S = 30.0


class TrainerProcessError(RuntimeError):
    """The trainer process died (or could not start); its calls cannot finish."""


class TrainerProcess:
    """One child process hosting one-device backends; `create` has `create_backend`'s signature."""

    def __init__(self, *, threads: int, other_cores: Collection[int] = ()) -> None:
        """Start the child with `threads` torch threads; its threads other than the training
        threads (the socket reader, the weight writer) run on `other_cores` (() = anywhere)."""
        assert threads >= 1, f"{threads=}"
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        cmd = [sys.executable, "-m", "rollouts.trainer.process_child", str(fd)]
        env = tracing.environment()  # the run's trace.json, when it keeps one
        self._process: subprocess.Popen | ForkedProcess = fork(
            cmd, env, {0: 0, 1: 1, 2: 2, fd: fd}
        ) or subprocess.Popen(cmd, pass_fds=(fd,), env=env)
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
            message = (target, name, tuple(map(pack, args)), kwargs)
            payload = dumps(name, message, prefix=call_id.to_bytes(8, "little"))
            self._pending[call_id] = future
            try:
                self._conn.send_bytes(payload)
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

    def create(self, config: Config, **kwargs: Any) -> RemoteBackend:
        """A one-device backend for `config` built in the child (`create_pytorch_backend`);
        returns at once (the child builds it in order before the backend's first call). Its
        weight snapshots stay in the child until written there."""
        backend_id = next(self._backend_ids)
        self.call_unchecked(backend_id, "create", config, **kwargs)
        link = ProcessLink(self, backend_id)
        return RemoteBackend(link, adapters=config.model.lora.enabled, snapshots=True)

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


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessLink:
    """The `BackendLink` to one backend in the trainer process (by its id there)."""

    host: TrainerProcess
    backend_id: int

    def call(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """The backend's method `name`, run in the child in order."""
        return self.host.call(self.backend_id, name, *args, **kwargs)

    def pin_thread(self, cores: tuple[int, ...]) -> None:
        """Run the child's training thread (and the torch threads it starts) on `cores` (not
        waited for: it runs before the backend's next call)."""
        self.host.call_unchecked(self.backend_id, "pin_thread", cores)

    def barrier(self) -> None:
        """One device: nothing to wait for."""
        return None

    def close(self) -> None:
        """Finish this backend's queued work and stop its training thread (the process stays;
        a dead one has nothing left to stop)."""
        with contextlib.suppress(TrainerProcessError):
            self.host.send(self.backend_id, "close", (), {}, check=False).result()
