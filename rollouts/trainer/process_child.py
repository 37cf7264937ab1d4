"""The trainer process's side (started by `process.TrainerProcess`): backends built with
`create_pytorch_backend`, their calls run in order, the replies sent when each finishes.

    python -m rollouts.trainer.process_child FD
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rollouts import tracing
from rollouts.gcpolicy import freeze_startup_objects
from rollouts.heap import keep_freed_memory
from rollouts.progress_bars import quiet_progress_bars
from rollouts.trainer.process_wire import HOST, pack, unpack
from rollouts.types import TrainFuture

RNG_FILE = "rng_trainer.pt"  # the trainer process's RNG, beside the backend's checkpoint files


def _then(future: Any, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
    """A future of `fn(result)` once `future` (a TrainFuture or a concurrent one) is done."""
    inner = future._future if isinstance(future, TrainFuture) else future
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def chain(done: concurrent.futures.Future) -> None:
        try:
            out.set_result(fn(done.result()))
        except BaseException as e:  # the caller gets it
            out.set_exception(e)

    inner.add_done_callback(chain)
    return out


class _Host:
    """The child's side: backends by id, weight snapshots by key, one writer thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.backends: dict[int, Any] = {}
        self.failed: dict[int, Exception] = {}  # start-up errors by target
        self.start_cores: set[int] | None = None  # this thread's cores before `init` pinned it
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.writer: concurrent.futures.ThreadPoolExecutor | None = None
        self.tracer = tracing.from_environment()  # the driver's trace.json, when it keeps one
        tracing.install(self.tracer)

    def reply(self, call_id: int, ok: bool, value: Any, where: str = "") -> None:
        if self.tracer is not None:  # the call's spans reach the run's trace before its reply
            self.tracer.flush()
        try:
            message = pickle.dumps((call_id, ok, value, where), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # a result or an error that does not pickle
            text = f"{type(value).__name__}: {value}" if not ok else f"{type(e).__name__}: {e}"
            message = pickle.dumps((call_id, False, RuntimeError(text), where))
        # a driver that is gone reads nothing: the main loop ends on its EOF
        with self.send_lock, contextlib.suppress(OSError, EOFError):
            self.conn.send_bytes(message)

    def fail(self, call_id: int, error: BaseException) -> None:
        self.reply(call_id, False, error, "".join(traceback.format_exception(error)))

    def handle(self, call_id: int, payload: bytes | memoryview) -> bool:
        """Run one call; False when it was the last (exit)."""
        try:
            target, name, args, kwargs = pickle.loads(payload)
            args = tuple(map(unpack, args))
        except Exception as e:  # e.g. a class the driver could import and this process cannot
            self.fail(call_id, e)
            return True
        if name == "exit":
            self.shutdown()
            self.reply(call_id, True, None)
            return False
        try:
            result = self.run(call_id, target, name, args, kwargs)
        except Exception as e:  # the caller's error, not the host's
            self.fail(call_id, e)
            return True
        if isinstance(result, TrainFuture):
            result = result._future
        if isinstance(result, concurrent.futures.Future):
            result.add_done_callback(lambda f, i=call_id: self.answer(i, f))
        else:
            self.reply(call_id, True, result)
        return True

    def answer(self, call_id: int, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is None:
            self.reply(call_id, True, pack(future.result()))
        else:
            self.fail(call_id, error)

    def keep(self, key: int, weights: dict[str, torch.Tensor]) -> int:
        self.snapshots[key] = weights
        return key

    def run(self, call_id: int, target: int, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "close" and target not in self.backends:
            return None  # never built: nothing to close
        for failed in (HOST, target):  # start-up work nobody waited for failed: so does every
            if failed in self.failed:  # later call of it (with the same error)
                raise self.failed[failed]
        if target == HOST or name == "create":
            try:
                return self.start_up(target, name, args, kwargs)
            except Exception as e:
                self.failed[target] = e
                raise
        return self.call_backend(call_id, target, name, args, kwargs)

    def start_up(self, target: int, name: str, args: tuple, kwargs: dict) -> Any:
        if target == HOST:
            assert name == "init", f"unknown host call {name!r}"
            return self.init(*args)
        from rollouts.trainer.factories import create_pytorch_backend

        with _on_cores(self.start_cores):  # start-up work may use every core (the engines'
            self.backends[target] = create_pytorch_backend(*args, **kwargs)  # start as well)
        freeze_startup_objects()  # full collections then skip the model and the imports
        return None

    def call_backend(self, call_id: int, target: int, name: str, args: tuple, kwargs: dict) -> Any:
        backend = self.backends[target]
        if name == "snapshot_weights":
            return _then(backend.copy_weights(), lambda w: self.keep(call_id, w))
        if name == "write_weights":
            key, path = args
            assert self.writer is not None, "init first"
            return self.writer.submit(backend.write_weights, self.snapshots.pop(key), path)
        if name == "save_checkpoint":
            return _then(backend.save_checkpoint(*args), lambda _: _save_rng(args[0]))
        if name == "load_checkpoint":
            return _then(backend.load_checkpoint(*args), lambda _: _load_rng(args[0]))
        if name == "close":
            self.backends.pop(target).close()
            return None
        return getattr(backend, name)(*args, **kwargs)

    def init(self, path: list[str], threads: int, other_cores: tuple[int, ...]) -> int:
        """The driver's import path (user plugins, scripts), torch threads and placement."""
        sys.path[:] = path
        torch.set_num_threads(threads)
        if other_cores and hasattr(os, "sched_setaffinity"):
            self.start_cores = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(other_cores))  # this thread; the writer inherits it
        quiet_progress_bars()
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")
        return os.getpid()

    def shutdown(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()
        if self.writer is not None:
            self.writer.shutdown(wait=True)


@contextlib.contextmanager
def _on_cores(cores: set[int] | None) -> Iterator[None]:
    """This thread on `cores` for the block (None: where it is)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _save_rng(path: Path) -> None:
    from rollouts.trainer.checkpoint import rng_state

    torch.save(rng_state(), Path(path) / RNG_FILE)


def _load_rng(path: Path) -> None:
    from rollouts.trainer.checkpoint import set_rng_state

    file = Path(path) / RNG_FILE
    if file.is_file():  # a checkpoint written by an in-process backend has none
        set_rng_state(torch.load(file, weights_only=True))


def serve(fd: int) -> None:
    """The child's main loop: calls from the driver, in order, until exit or EOF.

    SIGINT and SIGTERM are the driver's to handle (a clean stop still trains, checkpoints and
    then closes this process); a Ctrl-C that reaches the whole process group must not kill the
    trainer under it. The child still ends when the driver's end of the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep_freed_memory()  # a step reuses the last one's pages (`rollouts/heap.py`)
    conn = Connection(fd)
    host = _Host(conn)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the driver died: nothing will read our answers
            host.shutdown()
            return
        call_id = int.from_bytes(message[:8], "little")
        if not host.handle(call_id, memoryview(message)[8:]):
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    # every call is answered and every file written: skip the interpreter's teardown (about a
    # second of freeing torch state, which the driver's close would wait for)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
