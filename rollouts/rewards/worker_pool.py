"""A bounded pool of worker processes that answer one JSON line per request line.

For reward work that can hang holding a core (a sympy simplification in math-verify): a thread
cannot be killed, a process can. `WorkerPool.ask(request)` sends one JSON line to an idle worker
(started on first use, reused after) and awaits its one-line reply over trio streams, so the
await is cancellable. When it is cancelled (the scorer's `trio.fail_after` fired), or the worker
dies before it answers, that worker is SIGKILLed and reaped at once, and a later call starts a
fresh one: a hung request costs neither a core nor a thread. At most `size` workers run; callers
beyond them wait their turn (under their own timeouts).

A worker's first line says it is ready (`{"ready": true}`) or why it cannot be
(`{"error": "..."}`). Workers die with the run: `run_pool` kills a pool's workers when its trio run
ends (a system task), and each worker exits at EOF on stdin and, on Linux, asks for SIGKILL when
the thread that started it exits (`prctl(PR_SET_PDEATHSIG)`), so workers are spawned from the trio
thread, never from a worker thread (as `rollouts/engine/launch.py` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import trio

from rollouts import tracing

STARTUP_TIMEOUT_S = 60.0  # a worker's imports (sympy: 1-2 s) on a loaded machine
REAP_TIMEOUT_S = 5.0  # a SIGKILLed worker is gone in milliseconds; never wait forever
EXIT_GRACE_S = 1.0  # a worker that closed its stdout is exiting: its status, not our SIGKILL
MAX_LINE_BYTES = 1 << 22
READ_BYTES = 1 << 16


class WorkerDied(RuntimeError):
    """A worker exited (or was killed) before it answered its request."""


class WorkerStartError(RuntimeError):
    """A worker could not start: it said why, exited, or did not say it was ready in time."""


class _EndOfStream(Exception):
    """The worker closed its stdout (it exited)."""


def describe_exit(returncode: int | None) -> str:
    """'killed by SIGKILL', 'exit status 1' or 'still running' (for error messages)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@dataclasses.dataclass(slots=True, eq=False)
class Worker:
    """One worker process and the parent's ends of its pipes."""

    process: subprocess.Popen[bytes]
    to_worker: trio.lowlevel.FdStream
    from_worker: trio.lowlevel.FdStream
    pending: bytearray = dataclasses.field(default_factory=bytearray)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request line and read the reply line (`_EndOfStream` if the worker exits)."""
        line = json.dumps(request).encode() + b"\n"
        try:
            await self.to_worker.send_all(line)
        except trio.BrokenResourceError as e:
            raise _EndOfStream() from e
        return await self.read_line()

    async def read_line(self) -> dict[str, Any]:
        """The next JSON line the worker writes, as a dict."""
        while b"\n" not in self.pending:
            if len(self.pending) > MAX_LINE_BYTES:
                raise RuntimeError(f"worker pid {self.pid} wrote {len(self.pending)} bytes no line")
            chunk = await self.from_worker.receive_some(READ_BYTES)
            if not chunk:
                raise _EndOfStream()
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending = bytearray(rest)
        reply = json.loads(line)
        assert isinstance(reply, dict), f"worker pid {self.pid} wrote {line[:200]!r}"
        return reply

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGKILL the worker (after `grace_s` for one exiting on its own), reap it (bounded: it
        is gone in milliseconds), close the pipes."""
        if grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=REAP_TIMEOUT_S)
        self.to_worker.close()
        self.from_worker.close()


def spawn(command: tuple[str, ...]) -> Worker:
    """Start `command` with this process's pid appended (the worker checks it is still its
    parent), its stdin and stdout pipes to us; its stderr is ours."""
    assert command, "an empty worker command"
    to_read, to_write = os.pipe()  # not inherited by other children (PEP 446)
    from_read, from_write = os.pipe()
    try:
        process = subprocess.Popen([*command, str(os.getpid())], stdin=to_read, stdout=from_write)
    except BaseException:
        for fd in (to_write, from_read):
            os.close(fd)
        raise
    finally:
        os.close(to_read)
        os.close(from_write)
    return Worker(
        process=process,
        to_worker=trio.lowlevel.FdStream(to_write),
        from_worker=trio.lowlevel.FdStream(from_read),
    )


@dataclasses.dataclass(slots=True, eq=False)
class WorkerPool:
    """At most `size` workers running `command`, each answering one request at a time."""

    command: tuple[str, ...]
    size: int
    name: str  # what errors call the workers ("math-verify")
    limiter: trio.CapacityLimiter = dataclasses.field(init=False)
    idle: list[Worker] = dataclasses.field(default_factory=list)
    live: list[Worker] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.size >= 1, f"{self.size=} must be >= 1"
        self.limiter = trio.CapacityLimiter(self.size)

    def pids(self) -> list[int]:
        """The pids of the workers running now (idle or busy)."""
        return [w.pid for w in self.live]

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One worker's reply to `request`; a worker that dies first raises `WorkerDied`, and
        one whose caller is cancelled (a timeout) is killed. Either way it is replaced."""
        async with self.limiter:
            worker = self._idle_worker() or await self._start()
            try:
                with tracing.span(f"{self.name} worker {worker.pid}", "grade"):  # a rewards lane
                    reply = await worker.ask(request)
            except _EndOfStream:
                self._discard(worker, grace_s=EXIT_GRACE_S)
                how = describe_exit(worker.process.returncode)
                raise WorkerDied(
                    f"{self.name} worker pid {worker.pid} died before it answered ({how}); "
                    "the next call starts a new worker"
                ) from None
            except BaseException:  # cancelled (a timeout) or a bad reply: never reused
                self._discard(worker)
                raise
            self.idle.append(worker)
            return reply

    def close(self) -> None:
        """Kill every worker (the run is over)."""
        for worker in list(self.live):
            self._discard(worker)
        assert not self.live and not self.idle, f"{self.live=} {self.idle=}"

    def _idle_worker(self) -> Worker | None:
        while self.idle:
            worker = self.idle.pop()
            if worker.process.poll() is None:
                return worker
            self._discard(worker)  # died while idle: no request of ours was lost
        return None

    async def _start(self) -> Worker:
        worker = spawn(self.command)
        self.live.append(worker)
        try:
            with trio.fail_after(STARTUP_TIMEOUT_S):
                ready = await worker.read_line()
        except trio.TooSlowError:
            self._discard(worker)
            raise WorkerStartError(
                f"{self.name} worker pid {worker.pid} did not start in {STARTUP_TIMEOUT_S} s"
            ) from None
        except _EndOfStream:
            self._discard(worker, grace_s=EXIT_GRACE_S)
            how = describe_exit(worker.process.returncode)
            raise WorkerStartError(
                f"{self.name} worker pid {worker.pid} exited at start ({how}); see its stderr"
            ) from None
        except BaseException:
            self._discard(worker)
            raise
        if ready.get("ready") is not True:
            self._discard(worker)
            raise WorkerStartError(f"{self.name} worker cannot start: {ready.get('error', ready)}")
        return worker

    def _discard(self, worker: Worker, grace_s: float = 0.0) -> None:
        worker.kill(grace_s)
        if worker in self.live:
            self.live.remove(worker)
        if worker in self.idle:
            self.idle.remove(worker)


def run_pool(var: trio.lowlevel.RunVar[WorkerPool], make: Callable[[], WorkerPool]) -> WorkerPool:
    """This trio run's pool held in `var`: made on first use, its workers killed when the run
    ends (a system task, cancelled after the main task returns)."""
    try:
        return var.get()
    except LookupError:
        pass
    pool = make()
    var.set(pool)
    trio.lowlevel.spawn_system_task(_close_at_run_end, pool, name=f"close {pool.name} workers")
    return pool


async def _close_at_run_end(pool: WorkerPool) -> None:
    try:
        await trio.sleep_forever()
    finally:
        pool.close()
