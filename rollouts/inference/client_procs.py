"""Generation calls in processes of their own (`engines.client_processes`): the HTTP request and
the decode of its answer run in a worker process; the driver sends a small pickle and reads
back the decoded result.

At cluster batch sizes the driver's thread is the limit (`scripts/bench_driver.py`): about
half of its time a sample goes to httpx reading a group's answer (hundreds of KB of JSON) and to
decoding its per-token lists. A worker does both on another core, with the same `EngineHttp`
(retries, timeouts, errors) and the same decode function the call names; the driver unpickles
the result (a few times cheaper than the decode) and applies what only it knows (the weight
versions of its sync bracket).

Each worker (`python -m rollouts.inference.client_procs SOCKET`) listens on a Unix socket and
serves one call at a time a connection. The driver keeps idle connections for reuse, one
connection a call in flight. A call the driver cancels closes its connection: the worker sees
it close and cancels the HTTP request (the engine sees the disconnect, as with an in-process
client). A worker exits when the driver does (its stdin closes). A worker that died is started
again on the next call; the calls it held fail with `EngineUnavailable`, as an unreachable
engine's do.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import trio

from rollouts.gcpolicy import gc_paused

HEADER = struct.Struct("<Q")
START_TIMEOUT_S = 60.0


class WorkerGone(Exception):
    """The worker's connection closed before its answer came."""


async def send_frame(sock: trio.socket.SocketType, payload: bytes) -> None:
    """`payload`, prefixed by its length."""
    data = memoryview(HEADER.pack(len(payload)) + payload)
    while data:
        sent = await sock.send(data)
        data = data[sent:]


async def recv_exactly(sock: trio.socket.SocketType, size: int) -> bytearray | None:
    """`size` bytes, or None when the connection closed before the first of them."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = await sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return None
            raise WorkerGone(f"connection closed after {got} of {size} bytes")
        got += n
    return buffer


async def recv_frame(sock: trio.socket.SocketType) -> bytearray | None:
    """One length-prefixed frame, or None at a clean end of the connection."""
    head = await recv_exactly(sock, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    body = await recv_exactly(sock, size)
    if body is None:
        raise WorkerGone("connection closed after a frame's header")
    return body


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One generation call: which engine (`EngineHttp`'s arguments), and what to send."""

    url: str
    api_key: str
    options: Any  # HttpOptions, with client_processes 0 (the worker calls in process)
    method: str
    path: str
    kwargs: dict[str, Any]
    decode: Callable[[bytes], Any]


def picklable_error(error: BaseException) -> BaseException:
    """`error` when it pickles and unpickles as itself, else an EngineError with its text."""
    from rollouts.inference.http import EngineError

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return EngineError(f"{type(error).__name__}: {error}")
    return error


class ClientProcesses:
    """`count` worker processes that make generation calls for this process."""

    def __init__(self, count: int) -> None:
        assert count >= 1, f"{count=}"
        self.count = count
        self._dir = tempfile.mkdtemp(prefix="rollouts-clients-")
        self._procs: list[subprocess.Popen | None] = [None] * count
        # idle connections as plain sockets: one trio run (a test) must not close another's
        self._idle: list[list[socket.socket]] = [[] for _ in range(count)]
        self._turn = itertools.count()
        atexit.register(self.close)

    def _socket_path(self, i: int) -> str:
        return os.path.join(self._dir, f"{i}.sock")

    def _start(self, i: int) -> subprocess.Popen:
        """Worker `i` (again, if it died): its idle connections go with it."""
        for sock in self._idle[i]:
            sock.close()
        self._idle[i] = []
        path = self._socket_path(i)
        if os.path.exists(path):
            os.unlink(path)
        cmd = [sys.executable, "-m", "rollouts.inference.client_procs", path]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        self._procs[i] = proc
        return proc

    async def _connect(self, i: int) -> socket.socket:
        """A new connection to worker `i`, starting it if it is not running."""
        proc = self._procs[i]
        if proc is None or proc.poll() is not None:
            proc = self._start(i)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock = trio.socket.from_stdlib_socket(raw)
            try:
                await sock.connect(self._socket_path(i))
                return raw
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
            code = proc.poll()
            if code is not None or time.monotonic() > deadline:
                why = (
                    f"exited with code {code}"
                    if code is not None
                    else f"did not listen within {START_TIMEOUT_S:.0f}s"
                )
                raise RuntimeError(
                    f"engine client process {i} ({' '.join(proc.args)}) {why}; its error is "
                    "above. Set engines.client_processes = 0 to make the calls in this process"
                )
            await trio.sleep(0.02)

    async def call(self, call: Call) -> Any:
        """`call` made by a worker: its decoded result, or the error it raised."""
        from rollouts.inference.http import EngineUnavailable

        request = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        i = next(self._turn) % self.count
        proc = self._procs[i]
        if proc is not None and proc.poll() is not None:  # died: its connections with it
            self._procs[i] = None
            for idle in self._idle[i]:
                idle.close()
            self._idle[i] = []
        raw = self._idle[i].pop() if self._idle[i] else await self._connect(i)
        sock = trio.socket.from_stdlib_socket(raw)
        done = False
        try:
            try:
                await send_frame(sock, request)
                frame = await recv_frame(sock)
            except (WorkerGone, OSError) as e:
                frame, error = None, e
            else:
                error = None
            if frame is None:  # the worker died with the call (or after an idle keep-alive)
                raise EngineUnavailable(
                    f"{call.url}{call.path}: the engine client process closed the call ({error})"
                )
            done = True
        finally:
            if done:
                self._idle[i].append(raw)
            else:  # cancelled or failed mid-call: the worker sees the close and cancels
                sock.close()
        with gc_paused():
            ok, value = pickle.loads(frame)
            del frame
        if ok:
            return value
        raise value

    def close(self) -> None:
        """Stop the workers (they also exit when this process does)."""
        for idle in self._idle:
            for sock in idle:
                sock.close()
            idle.clear()
        for proc in self._procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self._procs = [None] * self.count
        shutil.rmtree(self._dir, ignore_errors=True)


_GROUPS: dict[tuple[int, int], ClientProcesses] = {}


def client_processes(count: int) -> ClientProcesses:
    """The process's shared group of `count` workers (one group per count, made on first use;
    a forked child makes its own)."""
    key = (os.getpid(), count)
    group = _GROUPS.get(key)
    if group is None:
        group = _GROUPS[key] = ClientProcesses(count)
        plural = "es" if count > 1 else ""
        print(f"[engines] generation calls in {count} client process{plural}", flush=True)
    return group


# ---- the worker ----


class Worker:
    """One worker: an `EngineHttp` per engine, a call at a time per connection."""

    def __init__(self) -> None:
        self.clients: dict[tuple[str, str, Any], Any] = {}

    def http(self, call: Call) -> Any:
        from rollouts.inference.http import EngineHttp

        key = (call.url, call.api_key, call.options)
        client = self.clients.get(key)
        if client is None:
            client = EngineHttp(call.url, api_key=call.api_key, options=call.options)
            self.clients[key] = client
        return client

    async def serve_connection(self, sock: trio.socket.SocketType) -> None:
        with sock:
            while True:
                try:
                    frame = await recv_frame(sock)
                except (WorkerGone, OSError):
                    return
                if frame is None:
                    return
                reply = await self.answer(sock, frame)
                if reply is None:  # the driver closed the call
                    return
                try:
                    await send_frame(sock, reply)
                except OSError:
                    return

    async def answer(self, sock: trio.socket.SocketType, frame: bytearray) -> bytes | None:
        """The pickled (ok, value) of one call; None when the driver closed it meanwhile."""
        closed = False
        outcome: tuple[bool, Any] = (False, None)
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal closed
                with contextlib.suppress(OSError):
                    await sock.recv(1)  # the driver sends nothing until the answer: a close
                closed = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                call: Call = pickle.loads(frame)
                del frame
                value = await self.http(call).json(
                    call.method, call.path, decode=call.decode, **call.kwargs
                )
                outcome = (True, value)
            except trio.Cancelled:
                raise
            except Exception as e:
                outcome = (False, picklable_error(e))
            nursery.cancel_scope.cancel()
        if closed:
            return None
        with gc_paused():
            try:
                return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # a result that does not pickle: the call fails, by name
                from rollouts.inference.http import EngineError

                error = EngineError(f"the engine client process cannot send its result: {e}")
                return pickle.dumps((False, error), protocol=pickle.HIGHEST_PROTOCOL)


async def serve(path: str) -> None:
    """Listen on `path` until stdin closes (the driver exited)."""
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(path + ".tmp")
    listener.listen(1024)
    os.rename(path + ".tmp", path)  # the driver connects once it listens
    worker = Worker()
    async with trio.open_nursery() as nursery:

        async def watch_parent() -> None:
            await trio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch_parent)
        while True:
            sock, _ = await listener.accept()
            nursery.start_soon(worker.serve_connection, sock)


def main() -> None:
    import rollouts.inference.http  # noqa: F401  (imported before the first call)
    from rollouts.gcpolicy import freeze_startup_objects

    freeze_startup_objects()
    trio.run(serve, sys.argv[1])


if __name__ == "__main__":
    main()
