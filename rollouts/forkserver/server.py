"""The forkserver itself: imports its preload list once, then forks each requested program and
makes it the program a fresh `python -m MODULE ...` or `python SCRIPT ...` would be:
- the same argv, environment, working directory, CPU affinity, umask and file descriptors (those
  the caller passed, at the numbers it gave; no other of the server's); `/proc/PID/cmdline` shows
  the argv (written over the server's padded one, so `ps` and the tests that find engines by their
  flags see it; NUL-padded at the end); `sys.path[0]` as the interpreter sets it, then the entries
  of a `PYTHONPATH` the server does not have;
- a request whose environment differs from the server's in a variable read at import time
  (`IMPORT_TIME`: OpenMP, torch, HF, Python's own) is refused: its modules would be set up
  differently. So is another interpreter, an interpreter option, an argv too long for the
  padding, and a `PYTHONPATH` entry holding a module the server imported from elsewhere. Not
  compared: the variables the server's imports set themselves (torch's inductor cache
  directory), and `HF_HUB_DISABLE_PROGRESS_BARS`, applied again in the program as an import would;
- `-u` (the one interpreter option taken) and `PYTHONUNBUFFERED` give it unbuffered stdout and
  stderr, as the interpreter does (torchrun starts its ranks with `-u`); a request may ask for a
  session of its own (`subprocess.Popen(start_new_session=True)`);
- `random` and numpy's global generator are reseeded from the OS as a fresh process's are;
  torch's default generator has not been used in the server (its fixed starting seed).

The server must hold one thread when it forks (a lock another thread held would stay held in
every program); it checks after its imports and exits otherwise, and callers then start fresh
processes. numpy's OpenBLAS starts a pool unless `OMP_NUM_THREADS=1` (the test suite sets it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rollouts.forkserver.client import Refused, read_line

IMPORT_TIME = (
    "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "LD_",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "XDG_", "TMPDIR",
)  # fmt: skip
PROGRESS_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"  # read at import, set again in each program
# set by torchrun for each rank and read only when torch.distributed runs, never at import
RUNTIME_ONLY = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
UNBUFFERED = "PYTHONUNBUFFERED"  # read at start-up only: applied in each program (`stdio`)
ENV_ROOM = "ROLLOUTS_FORKSERVER_ENV_ROOM"  # padding in the server's environment (see `become`)
PATH_VAR = "PYTHONPATH"  # may differ: its entries go on sys.path in the program
PR_SET_PDEATHSIG = 1


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that modules read when they are imported."""
    return {
        k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and not k.startswith(RUNTIME_ONLY)
    }


class Server:
    """The select loop: accept a request, fork it, report each program's exit to its caller,
    kill a program whose caller closed its socket."""

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

    def preload(self, modules: Sequence[str]) -> None:
        """Import `modules`; keep apart the variables those imports set themselves (torch's
        inductor sets its cache directory): a request that has them has them from its own."""
        before = import_env(os.environ)
        preload(modules)
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
                else:  # the caller's socket: closed (it sends nothing after its request)
                    self.selector.unregister(key.fileobj)
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(child[1], signal.SIGKILL)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            request, fds = read_request(conn)
            self.check(request, fds)
        except (Refused, OSError, ValueError, KeyError) as exc:
            print(f"refused: {exc}", flush=True)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": str(exc)}).encode() + b"\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        pid = os.fork()
        if pid == 0:
            self.child(request, conn, fds)
        for fd in fds:
            os.close(fd)
        print(f"forked {pid}: {' '.join(request['argv'][1:])[:300]}", flush=True)
        pidfd = os.pidfd_open(pid)
        self.selector.register(pidfd, selectors.EVENT_READ, ("exited", (pid, pidfd, conn)))
        try:
            socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
        except OSError:  # the caller is gone already
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return
        self.selector.register(conn, selectors.EVENT_READ, ("caller", (pid, pidfd)))

    def check(self, request: dict[str, Any], fds: list[int]) -> None:
        argv = request["argv"]
        if len(argv) < 2 or argv[0] != sys.executable:
            raise Refused(f"forks this interpreter ({sys.executable}) only, not {argv[:1]}")
        args = program_args(argv)
        if not args or (args[0].startswith("-") and (args[0] != "-m" or len(args) < 2)):
            option = args[0] if args else "-u"
            raise Refused(f"runs `-m MODULE` or a script, without interpreter options: {option}")
        theirs = {
            k: v
            for k, v in import_env(request["env"]).items()
            if k not in (PROGRESS_BARS, PATH_VAR, UNBUFFERED) and self.by_import.get(k) != v
        }
        mine = {k: v for k, v in self.env.items() if k not in (PATH_VAR, UNBUFFERED)}
        if theirs != mine:
            changed = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
            raise Refused(f"the environment differs in {changed}, read at import time")
        check_path(request["env"].get(PATH_VAR, ""), self.env.get(PATH_VAR, ""))
        if len(b"\0".join(a.encode() for a in argv)) >= room("arg"):
            raise Refused("a command line longer than the server's padded one")
        if sum(len(f"{k}={v}".encode()) + 1 for k, v in request["env"].items()) > room("env"):
            raise Refused("an environment larger than the server's padded one")
        if len(fds) != len(request["fds"]) or not {0, 1, 2} <= set(request["fds"]):
            raise Refused(f"fds {request['fds']} (0, 1 and 2 at least) and {len(fds)} sent")
        known = {0, 1, 2, self.selector.fileno(), *fds}
        known |= {key.fd for key in self.selector.get_map().values()}
        if clash := (open_fds() - known) & set(request["fds"]):
            raise Refused(f"file descriptors {sorted(clash)} are the server's own")

    def reap(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        _, status = os.waitpid(pid, 0)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        conn.close()

    def child(self, request: dict[str, Any], conn: socket.socket, fds: list[int]) -> NoReturn:
        """In the forked process: become the program `request` describes, run it, exit."""
        code = 1
        try:
            parent = os.getppid()
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != parent:
                os._exit(1)  # the server died before the signal was set
            if request.get("new_session"):
                os.setsid()
            for fd in [conn.fileno(), *(k.fd for k in self.selector.get_map().values())]:
                os.close(fd)  # the server's sockets and pidfds: the program holds none
            self.selector.close()
            place_fds(request["fds"], fds)
            become(request)
            code = run_program(program_args(request["argv"]))
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def program_args(argv: Sequence[str]) -> list[str]:
    """What follows the interpreter in `argv`, without a leading `-u` (`become` applies it)."""
    return list(argv[2:] if argv[1:2] == ["-u"] else argv[1:])


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON line and the file descriptors sent with it."""
    try:
        data, fds = read_line(conn, 64)
    except EOFError:
        raise ValueError("the caller closed the connection mid-request") from None
    return json.loads(data), fds


def check_path(theirs: str, mine: str) -> None:
    """A `PYTHONPATH` the server lacks is taken when none of its folders holds a module the
    server imported from elsewhere (the program would import it from there, fresh)."""
    if theirs == mine:
        return
    if mine:
        raise Refused(f"{PATH_VAR} differs from the server's ({mine!r}), read at start-up")
    for entry in filter(None, theirs.split(os.pathsep)):
        folder = os.path.realpath(entry)
        names = os.listdir(folder) if os.path.isdir(folder) else []
        for name in names:
            module = sys.modules.get(name.removesuffix(".py"))
            if module is None:
                continue
            paths = getattr(module, "__path__", None) or ()
            where = getattr(module, "__file__", None) or next(iter(paths), "")
            if not os.path.realpath(where).startswith(folder + os.sep):
                raise Refused(f"{PATH_VAR} entry {entry} holds {name}, imported from {where}")


def place_fds(targets: Sequence[int], fds: Sequence[int]) -> None:
    """The received `fds` at the numbers `targets` (inheritable, as a fresh process has them)."""
    top = max([*targets, *fds]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, high, strict=True):
        os.dup2(fd, target)
    for fd in high:
        os.close(fd)


def open_fds() -> set[int]:
    """The file descriptors open in this process (not the listing's own, closed by then)."""
    listed = map(int, os.listdir("/proc/self/fd"))
    return {fd for fd in listed if not _closed(fd)}


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _area(name: str) -> tuple[int, int]:
    """Where this process's argv ("arg") or initial environment ("env") lies in its memory
    (`/proc/self/stat`'s arg_start, arg_end, env_start, env_end)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    first = {"arg": 45, "env": 47}[name]
    return int(fields[first]), int(fields[first + 1])


def room(name: str) -> int:
    """The bytes of this process's argv ("arg") or initial environment ("env") area."""
    start, end = _area(name)
    return end - start


def overwrite(name: str, items: Sequence[str]) -> None:
    """Write `items` over this process's argv or environment area, NUL-separated and padded, as
    `/proc/self/cmdline` or `/proc/self/environ` show them. The environment area is written only
    once `os.environ` was rebuilt (its C strings are then elsewhere)."""
    start, end = _area(name)
    text = b"".join(a.encode() + b"\0" for a in items)
    assert len(text) <= end - start, f"{name}: {len(text)=} {end - start=}"
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def become(request: dict[str, Any]) -> None:
    """This forked process as a fresh interpreter running `request["argv"]` would start."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    overwrite("env", [f"{k}={v}" for k, v in request["env"].items()])  # /proc/PID/environ
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["affinity"])
    overwrite("arg", request["argv"])
    args = program_args(request["argv"])
    first = request["cwd"] if args[0] == "-m" else os.path.dirname(os.path.realpath(args[0]))
    extra = [p for p in request["env"].get(PATH_VAR, "").split(os.pathsep) if p]
    sys.path[:1] = [first, *(p for p in extra if p not in sys.path)]
    stdio(unbuffered=request["argv"][1] == "-u" or bool(request["env"].get(UNBUFFERED)))
    if "huggingface_hub" in sys.modules:
        progress_bars_as_imported(request["env"].get(PROGRESS_BARS))
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # from the OS, as at a fresh import
    atexit._clear()


def stdio(unbuffered: bool) -> None:
    """stdout and stderr as the interpreter makes them at start-up (whatever the server's were):
    with `-u` or `PYTHONUNBUFFERED`, text written through to the descriptor at each write;
    otherwise buffered, a line at a time on a terminal (and stderr always)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        lines = not unbuffered and (name == "stderr" or raw.isatty())
        text = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            stream.encoding,
            stream.errors,
            line_buffering=lines,
            write_through=unbuffered,
        )
        setattr(sys, name, text)


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


def run_program(args: list[str]) -> int:
    """`python ARGS` (`-m MODULE ...` or `SCRIPT ...`) in this process, its exit status as the
    interpreter's."""
    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]  # runpy puts the module's path first, as `-m` does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: join threads
    atexit._run_exitfuncs()
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def preload(modules: Sequence[str]) -> None:
    """Import `modules` (`module:attribute` gets an attribute too), and check that nothing
    started a thread (a fork copies only the calling thread: a lock another one held would stay
    held in every program)."""
    for name in modules:
        module, _, attribute = name.partition(":")
        imported = importlib.import_module(module)
        if attribute:
            getattr(imported, attribute)
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the forkserver has {len(threads)} threads after its imports"
    if "huggingface_hub" in sys.modules:
        progress_bars_as_imported(os.environ.get(PROGRESS_BARS))  # the attributes it sets exist


def main() -> NoReturn:
    """`python -m rollouts.forkserver SOCKET PARENT_PID PADDING [MODULE ...]`
    (`client.start_server`): it dies with PARENT_PID."""
    path, parent, _, *modules = sys.argv[1:]
    os.environ.pop(ENV_ROOM, None)  # its bytes stay: the room for each program's environment
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != int(parent):
        raise SystemExit(f"forkserver: its parent {parent} is gone")
    server = Server(path)  # listening first: early requests wait for the imports
    server.preload(modules)
    sys.stdout.flush()
    server.run()
