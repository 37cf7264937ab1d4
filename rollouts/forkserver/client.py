"""The asking side of the forkserver: `fork` a program (`python -m MODULE ...` or
`python SCRIPT ...`) with an environment and the file descriptors it starts with; a
`ForkedProcess` for it, or None where there is no server or it refuses (the caller then starts a
fresh process, as it would without one). `start_server` starts a server.

The forked program is the one a fresh process would be (`server.py` says how, and where it
refuses). It differs in two ways: its parent is the server, not the caller, and its hash seed is
the server's. The caller holds a `ForkedProcess`: a pidfd for signals (no pid reuse race) and a
socket on which the server reports the exit status (`Popen.returncode`'s convention). The program
dies with its caller: the server SIGKILLs it when that socket closes (the caller exited, however,
or dropped the handle); and with the server (the parent-death signal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "ROLLOUTS_FORKSERVER"
# before a program's `-m MODULE`: forked behind `proxy.py`, for a starter that holds its process
PROXY = ("-m", "rollouts.forkserver.proxy")
ARGV_ROOM = 16384  # bytes of padding in the server's argv, for the programs' command lines
ENV_ROOM = 65536  # and in its environment, for theirs (`/proc/PID/environ` shows each its own)
LISTEN_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 60.0  # the first request waits for the server's imports

_UNREACHED: set[str] = set()  # servers this process could not reach (warned once each)


class Refused(RuntimeError):
    """The server will not fork this program (the caller starts a fresh process)."""


class ForkedProcess:
    """A forked program, as much of `subprocess.Popen` as its callers use: `pid`, `args`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, pidfd: int) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._pidfd, self._buf = conn, pidfd, b""
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def forward(self, sig: int) -> None:
        """`send_signal` without waiting for the exit report's lock: safe in a signal handler
        that interrupted `wait` (a program that ended meanwhile is not signalled)."""
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> int | None:
        """The exit status once the server reported it (waiting up to `timeout`)."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            self._conn.settimeout(timeout)
            while b"\n" not in self._buf:
                try:
                    chunk = self._conn.recv(4096)
                except (TimeoutError, BlockingIOError):
                    return None
                if not chunk:  # the server is gone, and its programs with it (parent-death)
                    self._buf = b'{"exit": %d}\n' % -signal.SIGKILL
                self._buf += chunk
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["exit"])
            self._close()
            return self.returncode

    def _close(self) -> None:
        self._conn.close()
        with contextlib.suppress(OSError):
            os.close(self._pidfd)
        self._pidfd = -1

    def __del__(self) -> None:
        if self._pidfd >= 0:
            self._close()  # the server kills a program whose caller let go of it


def fork(
    argv: Sequence[str],
    env: Mapping[str, str],
    fds: Mapping[int, int],
    path: str | None = None,
    cwd: str | None = None,
    new_session: bool = False,
) -> ForkedProcess | None:
    """`argv` (this interpreter, optionally `-u`, then `-m MODULE` or a script, then its
    arguments) forked by a server at `path` (default: `$ROLLOUTS_FORKSERVER`; several, separated
    by `os.pathsep`, are asked in turn: servers of different environments), with `env`, `cwd`
    (default: ours), this process's CPU affinity and umask, `fds` (the program's fd -> ours: 0, 1
    and 2 at least; ours stay open here), in a session of its own if `new_session`. None when
    there is no server or every one refuses."""
    paths = [p for p in (path or os.environ.get(ENV_VAR, "")).split(os.pathsep) if p]
    umask = os.umask(0o22)
    os.umask(umask)
    request = {
        "argv": list(argv),
        "env": dict(env),
        "cwd": cwd or os.getcwd(),
        "fds": list(fds),
        "affinity": sorted(os.sched_getaffinity(0)),
        "umask": umask,
        "new_session": new_session,
    }
    refusals = []
    for server in paths:
        try:
            return _ask(server, request, list(fds.values()))
        except Refused as exc:  # this request only (the server's log says why too)
            refusals.append(f"{server}: {exc}")
        except (OSError, ValueError, KeyError, IndexError) as exc:  # no server there: say so once
            if server not in _UNREACHED:
                _UNREACHED.add(server)
                log.warning("forkserver %s: %s; processes start fresh", server, exc)
    if refusals:
        log.info("forkservers refused (%s); starting a fresh process", "; ".join(refusals))
    return None


def popen(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    start_new_session: bool = False,
) -> ForkedProcess | subprocess.Popen:
    """`subprocess.Popen(argv, env=, cwd=, stdout=, stderr=, start_new_session=)`, forked by a
    server where one takes it (`fork`), a fresh process otherwise. stdout and stderr: None (ours),
    a file object or descriptor, `subprocess.DEVNULL`, or (stderr) `subprocess.STDOUT`; a
    `subprocess.PIPE` always starts a fresh process (a ForkedProcess has no pipes)."""
    env = dict(os.environ if env is None else env)
    fresh = dict(env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    if subprocess.PIPE in (stdout, stderr) or not os.environ.get(ENV_VAR):
        return subprocess.Popen(list(argv), start_new_session=start_new_session, **fresh)
    opened: list[int] = []

    def fd_of(target: Any, default: int) -> int:
        if target is None:
            return default
        if target == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR))
            return opened[-1]
        return target if isinstance(target, int) else target.fileno()

    try:
        out = fd_of(stdout, 1)
        err = out if stderr == subprocess.STDOUT else fd_of(stderr, 2)
        cwd_s = None if cwd is None else os.path.abspath(cwd)
        proc = fork(
            list(argv), env, {0: 0, 1: out, 2: err}, cwd=cwd_s, new_session=start_new_session
        )
    finally:
        for fd in opened:
            os.close(fd)
    if proc is None:
        return subprocess.Popen(list(argv), start_new_session=start_new_session, **fresh)
    return proc


def _ask(path: str, request: dict, fds: list[int]) -> ForkedProcess:
    """One server's fork of `request`; `Refused`, or OSError where none answers."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        try:
            reply, got = read_line(conn, 1)
        except EOFError:
            raise Refused("the server closed the connection") from None
        answer = json.loads(reply)
        if "refused" in answer:
            raise Refused(answer["refused"])
        os.set_inheritable(got[0], False)
        return ForkedProcess(request["argv"], conn, int(answer["pid"]), got[0])
    except BaseException:
        conn.close()
        raise


def read_line(conn: socket.socket, max_fds: int) -> tuple[bytes, list[int]]:
    """One line from `conn` and the file descriptors sent with it (EOFError: closed before)."""
    data, fds = b"", []
    while b"\n" not in data:
        chunk, more, _, _ = socket.recv_fds(conn, 65536, max_fds)
        if not chunk:
            raise EOFError("closed mid-line")
        data, fds = data + chunk, fds + more
    return data, fds


def start_server(
    path: str, env: Mapping[str, str], log_path: str, preload: Sequence[str]
) -> subprocess.Popen:
    """Start a forkserver listening on `path` with `env` (the environment its programs get, as
    far as their imports read it), that imports `preload` (module names; `module:attribute`
    also gets an attribute, for a package's lazy ones) and dies with this process. Returns once
    it listens; it imports in the background and answers requests once it has."""
    padding = "-" * ARGV_ROOM
    cmd = [sys.executable, "-m", "rollouts.forkserver", path, str(os.getpid()), padding, *preload]
    with open(log_path, "ab") as out:
        room = {"ROLLOUTS_FORKSERVER_ENV_ROOM": "-" * ENV_ROOM}
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, **room})
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # bound: the imports come after
    return server
