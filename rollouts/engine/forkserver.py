"""A forkserver for built-in engines: one process that has imported what an engine imports
(torch, transformers' Llama, the server) forks each engine from there, so an engine start costs
its own work, not the 3-4 CPU-seconds of imports (`scripts/bench_engine_start.py`).

Opt-in: `ROLLOUTS_ENGINE_FORKSERVER=<socket path>` in the environment of whatever starts engines
(the test suite sets it, `tests/conftest.py`). `launch.spawn` asks the server first and starts a
fresh process when there is none, or when it refuses. The forked engine is the engine a fresh
process would be:
- the same argv, environment, working directory and log file; `/proc/PID/cmdline` shows the
  argv (written over the server's padded one, so `ps` and the tests that find engines by their
  flags see it; NUL-padded at the end);
- a request whose environment differs from the server's in a variable read at import time
  (`IMPORT_TIME`: OpenMP, torch, HF, Python's own) is refused: its modules would be set up
  differently. So is another interpreter, or an argv too long for the padding. Two are not
  compared: those the server's imports set themselves (torch's inductor cache directory), and
  `HF_HUB_DISABLE_PROGRESS_BARS`, applied again in the engine as an import would;
- `random` and numpy's global generator are reseeded from the OS as a fresh process's are;
  torch's default generator has not been used in the server (its fixed starting seed).
It differs in two ways: its parent is the server, not the launcher, and its hash seed is the
server's. The launcher holds a `ForkedProcess`: a pidfd for signals (no pid reuse race) and a
socket on which the server reports the exit status (`Popen.returncode`'s convention). The engine
dies with its launcher: the server SIGKILLs it when that socket closes (the launcher exited,
however, or dropped the handle); and with the server (the parent-death signal).

The server must hold one thread when it forks (a lock another thread held would stay held in
every engine); it checks after its imports and exits otherwise, and launchers then start fresh
processes. numpy's OpenBLAS starts a pool unless `OMP_NUM_THREADS=1` (the test suite sets it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

ENV_VAR = "ROLLOUTS_ENGINE_FORKSERVER"
IMPORT_TIME = (
    "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "LD_",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "XDG_", "TMPDIR",
)  # fmt: skip
PROGRESS_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"  # read at import, set again in each engine
ARGV_ROOM = 16384  # bytes of padding in the server's argv, for the engines' command lines
LISTEN_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 60.0  # the first request waits for the server's imports
PR_SET_PDEATHSIG = 1


_UNREACHED: set[str] = set()  # servers this process could not reach (warned once each)


class Refused(RuntimeError):
    """The server will not fork this engine (the launcher starts a fresh process)."""


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that modules read when they are imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


# ----------------------------------------------------------------------------- the launcher's side


class ForkedProcess:
    """A forked engine, as much of `subprocess.Popen` as the launcher uses: `pid`, `args`,
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
                if not chunk:  # the server is gone, and its engines with it (parent-death signal)
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
            self._close()  # the server kills an engine whose launcher let go of it


def fork_engine(
    argv: Sequence[str], env: Mapping[str, str], log_path: str, path: str | None = None
) -> ForkedProcess | None:
    """`argv` (this interpreter, `-m rollouts.engine ...`) forked by the server at `path`
    (default: `$ROLLOUTS_ENGINE_FORKSERVER`); None when there is none or it refuses."""
    path = path or os.environ.get(ENV_VAR)
    if not path:
        return None
    request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "log": log_path}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(path)
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply, fds = b"", []
        while b"\n" not in reply:
            data, more, _, _ = socket.recv_fds(conn, 4096, 1)
            if not data:
                raise Refused("the server closed the connection")
            reply, fds = reply + data, fds + more
        answer = json.loads(reply)
        if "refused" in answer:
            raise Refused(answer["refused"])
        os.set_inheritable(fds[0], False)
        return ForkedProcess(list(argv), conn, int(answer["pid"]), fds[0])
    except (OSError, ValueError, KeyError, IndexError) as exc:  # no server there: say so once
        conn.close()
        if path not in _UNREACHED:
            _UNREACHED.add(path)
            log.warning("engine forkserver %s: %s; engines start fresh", path, exc)
        return None
    except Refused as exc:  # this request only (its log says why too)
        conn.close()
        log.info("engine forkserver %s: %s; starting a fresh process", path, exc)
        return None


def start_server(path: str, env: Mapping[str, str], log_path: str) -> subprocess.Popen:
    """Start a forkserver listening on `path` with `env` (the environment engines get), dying
    with this process. Returns once it listens; it imports in the background and answers
    requests once it has (a launcher waits for that)."""
    from rollouts.engine.launch import dies_with_parent

    cmd = [sys.executable, "-m", "rollouts.engine.forkserver", path, "-" * ARGV_ROOM]
    with open(log_path, "ab") as out:
        server = subprocess.Popen(
            dies_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env)
        )
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # bound: the imports come after
    return server


# ------------------------------------------------------------------------------- the server's side


class Server:
    """The select loop: accept a request, fork it, report each engine's exit to its launcher,
    kill an engine whose launcher closed its socket."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.env: dict[str, str] = {}
        self.by_import: dict[str, str] = {}

    def preload(self) -> None:
        """Import what an engine imports; keep apart the variables those imports set themselves
        (torch's inductor sets its cache directory): a request that has them has them from its
        own imports."""
        before = import_env(os.environ)
        preload()
        after = import_env(os.environ)
        self.by_import = {k: v for k, v in after.items() if k not in before}
        self.env = {k: v for k, v in before.items() if k != PROGRESS_BARS}

    def run(self) -> NoReturn:
        while True:
            for key, _ in self.selector.select():
                what, child = key.data
                if what == "accept":
                    self.accept()
                elif what == "exited":
                    self.reap(*child)
                else:  # the launcher's socket: closed (it sends nothing after its request)
                    self.selector.unregister(key.fileobj)
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(child[1], signal.SIGKILL)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(10.0)
            request = json.loads(conn.makefile("rb").readline())
            self.check(request)
        except (Refused, OSError, ValueError, KeyError) as exc:
            print(f"refused: {exc}", flush=True)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": str(exc)}).encode() + b"\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.child(request, conn)
        print(f"forked {pid}: {' '.join(request['argv'][3:])}", flush=True)
        pidfd = os.pidfd_open(pid)
        self.selector.register(pidfd, selectors.EVENT_READ, ("exited", (pid, pidfd, conn)))
        try:
            socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
        except OSError:  # the launcher is gone already
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return
        self.selector.register(conn, selectors.EVENT_READ, ("launcher", (pid, pidfd)))

    def check(self, request: dict[str, Any]) -> None:
        argv = request["argv"]
        if argv[:3] != [sys.executable, "-m", "rollouts.engine"]:
            raise Refused(f"forks `{sys.executable} -m rollouts.engine` only, not {argv[:3]}")
        theirs = {
            k: v
            for k, v in import_env(request["env"]).items()
            if k != PROGRESS_BARS and self.by_import.get(k) != v
        }
        if theirs != self.env:
            keys = theirs.keys() | self.env.keys()
            changed = sorted(k for k in keys if theirs.get(k) != self.env.get(k))
            raise Refused(f"the environment differs in {changed}, read at import time")
        if len(b"\0".join(a.encode() for a in argv)) >= argv_room():
            raise Refused(f"a command line longer than its {ARGV_ROOM} bytes of room")

    def reap(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        _, status = os.waitpid(pid, 0)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        conn.close()

    def child(self, request: dict[str, Any], conn: socket.socket) -> NoReturn:
        """In the forked process: become the engine `request` describes, run it, exit."""
        code = 1
        try:
            parent = os.getppid()
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != parent:
                os._exit(1)  # the server died before the signal was set
            for fd in [conn.fileno(), *(k.fd for k in self.selector.get_map().values())]:
                os.close(fd)  # the server's sockets and pidfds: the engine holds none
            self.selector.close()
            become(request)
            code = run_engine(request["argv"][3:])
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def argv_room() -> int:
    """The bytes of this process's argv area (`/proc/self/stat`'s arg_start and arg_end)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[46]) - int(fields[45])


def set_cmdline(argv: Sequence[str]) -> None:
    """Write `argv` over this process's argv area (NUL-padded), as `/proc/self/cmdline` shows it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])
    text = b"\0".join(a.encode() for a in argv) + b"\0"
    assert len(text) <= end - start, f"{len(text)=} {end - start=}"
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def become(request: dict[str, Any]) -> None:
    """This forked process as a fresh `python -m rollouts.engine ...` would start."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, to)
    os.close(log)
    os.close(null)
    set_cmdline(request["argv"])
    sys.path[0] = request["cwd"]  # as `-m` puts it
    progress_bars_as_imported(request["env"].get(PROGRESS_BARS))
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # from the OS, as at a fresh import
    atexit._clear()


def progress_bars_as_imported(value: str | None) -> None:
    """huggingface_hub's and transformers' progress bars as a fresh import with
    `HF_HUB_DISABLE_PROGRESS_BARS=value` sets them (the driver sets it for its engines)."""
    import huggingface_hub.constants as hub_constants
    from transformers.utils import logging as hf_logging

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module, not its class

    off = None if value is None else value.upper() in hub_constants.ENV_VARS_TRUE_VALUES
    hub_constants.HF_HUB_DISABLE_PROGRESS_BARS = hub_tqdm.HF_HUB_DISABLE_PROGRESS_BARS = off
    hub_tqdm.progress_bar_states.clear()
    hf_logging._tqdm_active = not hub_tqdm.are_progress_bars_disabled()


def run_engine(args: list[str]) -> int:
    """`python -m rollouts.engine ARGS` in this process, its exit status as the interpreter's."""
    sys.argv = ["-m", *args]  # runpy puts the module's path first, as `-m` does
    try:
        runpy.run_module("rollouts.engine", run_name="__main__", alter_sys=True)
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: join threads
    atexit._run_exitfuncs()
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def preload() -> None:
    """Import what an engine imports, and check that nothing started a thread (a fork copies
    only the calling thread: a lock another one held would stay held in every engine)."""
    import torch  # noqa: F401
    import trio  # noqa: F401
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401

    import rollouts.engine.app
    import rollouts.engine.cli  # noqa: F401  (not __main__: runpy runs that one fresh)

    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the forkserver has {len(threads)} threads after its imports"
    progress_bars_as_imported(os.environ.get(PROGRESS_BARS))  # the attributes it sets exist


def main() -> NoReturn:
    """`python -m rollouts.engine.forkserver SOCKET PADDING` (see `start_server`)."""
    server = Server(sys.argv[1])  # listening first: early requests wait for the imports
    server.preload()
    sys.stdout.flush()
    server.run()


if __name__ == "__main__":
    main()
