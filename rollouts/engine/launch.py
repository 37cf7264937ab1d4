"""Starting built-in engine servers (`rollouts serve`) as subprocesses on free loopback ports.

`engine_server(model_dir)` is the async context manager most code wants (yields the URL);
`engine_process` yields an `EngineProcess` (url + process, so a test can kill it);
`serve_engine` is the `nursery.start` form for long-lived engines; `start_engine_sync` is the
blocking form for module-scoped test fixtures (pytest-trio fixtures cannot be module-scoped).
Every wait is bounded: start-up by `startup_timeout_s`, shutdown by a grace period then SIGKILL.

A server dies with the process that started it, however that one ends (SIGKILL included): on
Linux the server is started through a tiny launcher that sets the parent-death signal
(`prctl(PR_SET_PDEATHSIG, SIGKILL)`) and then execs the server. The kernel sends it when the
*thread* that forked the server exits, so servers are spawned from the trio thread (or the
caller's), never from a worker thread. `serve_engines` restarts a server that exits (at most
`max_restarts` times each) on the same port; the pool's health check brings it back.

Where `$ROLLOUTS_FORKSERVER` names a running forkserver (`rollouts/forkserver/`; the test suite
starts two), a server is forked from there instead: the same server, a tenth of the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from rollouts.config.engine_options import EngineOptions, command_line
from rollouts.forkserver import ENV_VAR as FORKSERVER_VAR
from rollouts.forkserver import ForkedProcess, fork
from rollouts.openmp import short_spin_waits
from rollouts.wire.ports import free_port
from rollouts.wire.tls import tls_context

# what a forkserver imports for engines (`rollouts/forkserver/`, `start_server`'s preload)
ENGINE_PRELOAD = (
    "torch",
    "trio",
    "transformers:LlamaForCausalLM",
    "transformers:PreTrainedTokenizerFast",
    "rollouts.engine.app",
    "rollouts.engine.cli",  # not __main__: runpy runs that one fresh
)
HEALTH_POLL_S = 0.1
STOP_GRACE_S = 5.0
PORT_ATTEMPTS = 3
RESTART_POLL_S = 0.5

# argv[1] = the parent's pid; the rest is the server's argv (after the interpreter)
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the parent died before the signal was set\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class EngineStartError(RuntimeError):
    """The server process exited or did not become healthy in time (message has its log tail)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """How to start one built-in engine server: its options (`options.port` 0: a free port,
    chosen at each start) and what the launcher itself needs."""

    options: EngineOptions
    extra_args: tuple[str, ...] = ()  # more flags of `rollouts serve`, as they are
    startup_timeout_s: float = 120.0
    log_path: str | None = None  # None = a temp file


@dataclasses.dataclass(slots=True)
class EngineProcess:
    """A running server: its URL, its process, and the file its output goes to."""

    url: str
    process: subprocess.Popen | ForkedProcess
    log_path: str
    api_key: str = ""
    temp_log: bool = False  # the log is a temp file of ours: `discard_log` removes it

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output (for error messages)."""
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def discard_log(self) -> None:
        """Remove the log of a server we stopped if it is a temp file of ours (a log the caller
        named stays, as does the log of a server that exited by itself: why it did)."""
        stopped = (0, -signal.SIGTERM, -signal.SIGKILL)
        if self.temp_log and self.process.returncode in stopped:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    def kill(self) -> None:
        """SIGKILL the server at once (fault-injection tests)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=STOP_GRACE_S)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace_s`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=grace_s)


def server_command(spec: EngineSpec, port: int) -> list[str]:
    """The argv that starts the server for `spec` on `port`."""
    options = dataclasses.replace(spec.options, port=port)
    return [sys.executable, "-m", "rollouts.engine", *command_line(options), *spec.extra_args]


def dies_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` (a python command) behind the launcher that sets the parent-death signal (Linux)."""
    assert cmd[0] == sys.executable, f"{cmd[0]=} is not this interpreter"
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *cmd[1:]]


def engine_env() -> dict[str, str]:
    """The environment an engine server runs with: this process's, quiet and offline, with
    short OpenMP spin-waits."""
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    short_spin_waits(env)
    return env


def spawn(spec: EngineSpec) -> EngineProcess:
    """Start the server process (returns at once; see `wait_healthy*`); it dies with us. Forked
    by the forkserver where `$ROLLOUTS_FORKSERVER` names one (`rollouts/forkserver/`)."""
    port = spec.options.port or free_port(spec.options.host)
    if spec.log_path:
        log_path = spec.log_path
    else:
        fd, log_path = tempfile.mkstemp(prefix=f"rollouts-serve-{port}-", suffix=".log")
        os.close(fd)
    env, cmd = engine_env(), server_command(spec, port)
    process: subprocess.Popen | ForkedProcess | None = _forked(cmd, env, log_path)
    if process is None:  # no forkserver (the default), or it refused: a fresh process
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                dies_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, env=env
            )
    url = f"http://{spec.options.host}:{port}"
    return EngineProcess(
        url=url,
        process=process,
        log_path=log_path,
        api_key=spec.options.api_key,
        temp_log=not spec.log_path,
    )


def _forked(cmd: list[str], env: dict[str, str], log_path: str) -> ForkedProcess | None:
    """The server forked by the forkserver (stdin from /dev/null, output to the log), if any."""
    if not os.environ.get(FORKSERVER_VAR):
        return None
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        return fork(cmd, env, {0: null, 1: log, 2: log})
    finally:
        os.close(log)
        os.close(null)


def _exited(proc: EngineProcess) -> EngineStartError | None:
    code = proc.process.poll()
    if code is None:
        return None
    return EngineStartError(f"engine server exited with {code} at start:\n{proc.log_tail()}")


def wait_healthy_sync(proc: EngineProcess, timeout_s: float) -> None:
    """Block until GET /health is 200; EngineStartError if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, verify=tls_context()) as client:
        while time.monotonic() < deadline:
            if (err := _exited(proc)) is not None:
                raise err
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{proc.url}/health").status_code == 200:
                    return
            time.sleep(HEALTH_POLL_S)
    proc.stop()
    raise EngineStartError(f"engine server not healthy after {timeout_s}s:\n{proc.log_tail()}")


async def wait_healthy(proc: EngineProcess, timeout_s: float) -> None:
    """Async `wait_healthy_sync`."""
    async with httpx.AsyncClient(timeout=2.0, verify=tls_context()) as client:
        with trio.move_on_after(timeout_s):
            while True:
                if (err := _exited(proc)) is not None:
                    raise err
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{proc.url}/health")).status_code == 200:
                        return
                await trio.sleep(HEALTH_POLL_S)
    await trio.to_thread.run_sync(proc.stop)
    raise EngineStartError(f"engine server not healthy after {timeout_s}s:\n{proc.log_tail()}")


def _retryable(err: EngineStartError, spec: EngineSpec) -> bool:
    """A port taken between choosing and binding it is worth another free port."""
    return not spec.options.port and "address already in use" in str(err).lower()


def start_engine_sync(spec: EngineSpec) -> EngineProcess:
    """Start a server and block until it is healthy (retries a lost port race, bounded)."""
    for attempt in range(PORT_ATTEMPTS):
        proc = spawn(spec)
        try:
            wait_healthy_sync(proc, spec.startup_timeout_s)
            return proc
        except EngineStartError as err:
            if attempt + 1 == PORT_ATTEMPTS or not _retryable(err, spec):
                raise
    raise AssertionError("unreachable")


async def start_engine(spec: EngineSpec) -> EngineProcess:
    """Async `start_engine_sync`."""
    for attempt in range(PORT_ATTEMPTS):
        proc = spawn(spec)
        try:
            await wait_healthy(proc, spec.startup_timeout_s)
            return proc
        except EngineStartError as err:
            if attempt + 1 == PORT_ATTEMPTS or not _retryable(err, spec):
                raise
    raise AssertionError("unreachable")


def engine_spec(model_dir: str | Path, **kwargs: Any) -> EngineSpec:
    """The spec of a server on `model_dir` from keywords: EngineSpec's own (`extra_args`,
    `startup_timeout_s`, `log_path`) and EngineOptions' (`max_batch=8`, `api_key=...`; `port`
    0, a free one, unless given)."""
    own = {f.name for f in dataclasses.fields(EngineSpec)} - {"options"}
    launcher = {k: tuple(v) if k == "extra_args" else v for k, v in kwargs.items() if k in own}
    options = {k: v for k, v in kwargs.items() if k not in own}
    for key in ("weights_roots", "cpus"):
        if key in options:
            options[key] = tuple(options[key])
    options.setdefault("port", 0)
    return EngineSpec(options=EngineOptions(model=str(model_dir), **options), **launcher)


@contextlib.asynccontextmanager
async def engine_process(model_dir: str | Path, **kwargs: Any) -> AsyncIterator[EngineProcess]:
    """A healthy server for the duration of the block (kwargs: EngineSpec fields)."""
    proc = await start_engine(engine_spec(model_dir, **kwargs))
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(proc.stop)
        proc.discard_log()


@contextlib.asynccontextmanager
async def engine_server(model_dir: str | Path, **kwargs: Any) -> AsyncIterator[str]:
    """`async with engine_server(dir, port=None, api_key=..., max_batch=...) as url:`."""
    async with engine_process(model_dir, **kwargs) as proc:
        yield proc.url


@contextlib.contextmanager
def engine_server_sync(model_dir: str | Path, **kwargs: Any) -> Iterator[EngineProcess]:
    """Blocking form for module-scoped fixtures: yields the EngineProcess, stops it after."""
    proc = start_engine_sync(engine_spec(model_dir, **kwargs))
    try:
        yield proc
    finally:
        proc.stop()
        proc.discard_log()


async def serve_engine(
    model_dir: str | Path, *, task_status: Any = trio.TASK_STATUS_IGNORED, **kwargs: Any
) -> None:
    """`url = await nursery.start(serve_engine, model_dir, ...)`: runs until cancelled."""
    async with engine_process(model_dir, **kwargs) as proc:
        task_status.started(proc.url)
        await trio.sleep_forever()


async def serve_engines(
    spec: EngineSpec,
    count: int,
    *,
    max_restarts: int = 0,
    restart_from: Callable[[], tuple[str, str] | None] | None = None,
    on_gone: Callable[[str], None] | None = None,
    cpus_per_engine: Sequence[Sequence[int]] = (),
    log_paths: Sequence[str] = (),
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start `count` engines of `spec` at once (each on its own free port); `started(urls)`;
    restart one that exits (at most `max_restarts` times each, same port, not waited for: the
    pool's health check finds it) on `restart_from()` = (model dir, weight version) when it
    gives one that exists (the weights served now: the starting model may have been rotated
    away), else on the starting model; `on_gone(url)` when one exits with no restart left; runs
    until cancelled, then stops them all. Engine i runs on cores `cpus_per_engine[i]` and logs
    to `log_paths[i]` (appended, across restarts) when given. Use with `functools.partial` and
    `nursery.start`."""
    assert count >= 1, f"{count=}"
    assert max_restarts >= 0, f"{max_restarts=}"
    assert not cpus_per_engine or len(cpus_per_engine) == count, f"{cpus_per_engine=} {count=}"
    assert not log_paths or len(log_paths) == count, f"{log_paths=} {count=}"
    assert not spec.options.port or count == 1, f"{count=} engines cannot share one port"
    specs = [
        dataclasses.replace(
            with_options(spec, cpus=tuple(cpus_per_engine[i]) if cpus_per_engine else None),
            log_path=log_paths[i] if log_paths else spec.log_path,
        )
        for i in range(count)
    ]
    procs: list[EngineProcess] = []
    try:
        procs = [spawn(s) for s in specs]
        async with trio.open_nursery() as nursery:
            for proc in procs:
                nursery.start_soon(wait_healthy, proc, spec.startup_timeout_s)
        task_status.started([p.url for p in procs])
        await _restart_exited(procs, specs, max_restarts, restart_from, on_gone)
    finally:
        with trio.CancelScope(shield=True):
            for proc in procs:
                await trio.to_thread.run_sync(proc.stop)
                proc.discard_log()


def with_options(spec: EngineSpec, **changes: Any) -> EngineSpec:
    """`spec` with those of its options that `changes` gives (None: left as they are)."""
    given = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, **given))


async def _restart_exited(
    procs: list[EngineProcess],
    specs: Sequence[EngineSpec],
    max_restarts: int,
    restart_from: Callable[[], tuple[str, str] | None] | None,
    on_gone: Callable[[str], None] | None = None,
) -> None:
    """Until cancelled: replace an exited server in `procs` by a new one on its port."""
    restarts = [0] * len(procs)
    while True:
        await trio.sleep(RESTART_POLL_S)
        for i, proc in enumerate(procs):
            code = proc.process.poll()
            if code is None or restarts[i] > max_restarts:
                continue
            restarts[i] += 1
            if restarts[i] > max_restarts:
                print(f"[engines] {proc.url} exited ({code}); no restart left", flush=True)
                if on_gone is not None:
                    on_gone(proc.url)
                continue
            port = int(proc.url.rsplit(":", 1)[1])
            print(
                f"[engines] {proc.url} exited ({code}); restart {restarts[i]}/{max_restarts}",
                flush=True,
            )
            now = restart_from() if restart_from is not None else None
            if now is not None and Path(now[0], "config.json").is_file():
                again = with_options(specs[i], port=port, model=now[0], weight_version=now[1])
            else:
                again = with_options(specs[i], port=port)
            procs[i] = spawn(again)  # from the trio thread: see the module doc
