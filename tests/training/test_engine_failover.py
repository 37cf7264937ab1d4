"""Engines of a run under faults, with real processes: a SIGKILLed engine, a SIGKILLed trainer,
and a server that never answers.

- The weight sync skips (marks down) an engine that died; the run's engine supervisor restarts it
  on its port, and the pool's health check makes it load the current weights and prove their
  version before it gets a request.
- Engines started by a process die with it (parent-death signal), even when it is SIGKILLed.
- `engines.request_timeout_s` and `engines.max_retries` reach the clients the driver builds.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import trio

from rollouts.config import config_from_dict
from rollouts.driver.engines import open_engines
from rollouts.inference.http import EngineUnavailable
from rollouts.inference.sync import SyncOptions
from rollouts.weights.disk import DiskDelivery
from rollouts.wire.generation import SamplingParams

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


def server_pids(marker: str) -> list[int]:
    """Pids of live `rollouts.engine` processes whose command line holds `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "rollouts.engine" in cmdline and marker in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def wait_gone(marker: str, timeout_s: float = 20.0) -> list[int]:
    """Poll until no server with `marker` is left (bounded); the pids still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := server_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _once(path: str, version: str) -> DiskDelivery:
    """A disk delivery that tries each engine once."""
    options = SyncOptions(attempts=1, retry_delay_s=0.0)
    return DiskDelivery(path=path, version=version, options=options)


def _config(model_dir: Path, builtin: dict | None = None, **engines: object):
    builtin = {"num_engines": 2, "max_batch": 8} | (builtin or {})
    table = {
        "model": {"path": str(model_dir)},
        "engines": {"health_interval_s": 0.5, "builtin": builtin} | engines,
    }
    return config_from_dict(table, "test")


async def test_a_dead_engine_is_skipped_then_restarted_on_the_current_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    start, v1, v2 = (tmp_path / name for name in ("start", "v1", "v2"))
    for copy in (start, v1, v2):  # the starting checkpoint and two weight copies
        shutil.copytree(tiny_model_dir, copy)
    config = _config(tiny_model_dir, {"max_restarts": 1}, max_retries=1, request_timeout_s=30.0)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    async with open_engines(config, start, "0") as pool:
        assert pool.engines[0].http.options.timeout_s == 30.0
        assert pool.engines[0].http.options.max_retries == 1
        assert (await pool.sync(DiskDelivery(path=str(v1), version="1"))).ok
        shutil.rmtree(start)  # rotated away: a restart cannot use the starting model
        port = pool.engines[1].url.rsplit(":", 1)[1]
        (victim,) = server_pids(f"--port {port}")
        os.kill(victim, signal.SIGKILL)
        report = await pool.sync(_once(str(v2), "2"))
        assert report.results[0].ok, report
        assert await pool.engines[0].weight_version() == "2"
        with trio.fail_after(120):  # restarted (on v1), reloaded v2, proved it, routed again
            while not all(pool.up):
                await trio.sleep(0.2)
        assert await pool.engines[1].weight_version() == "2"
        (restarted,) = server_pids(f"--port {port}")
        assert restarted != victim
        assert str(start) not in Path(f"/proc/{restarted}/cmdline").read_text()
        pool.states[0].in_flight = 100  # route to the restarted engine
        completion = await pool.generate([1, 2, 3], sampling)
        assert completion.weight_version == "2"


async def test_a_sync_waits_for_its_only_engine_to_come_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The only engine dies just before a sync, with a restart left: the sync waits (bounded by
    engines.wait_for_up_s) for it to come back on the new weights, as a generation waits, rather
    than stop the run (found by `scripts/chaos.py --seed 0`: a run stopped at the sync)."""
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, v1)
    config = _config(tiny_model_dir, {"num_engines": 1, "max_restarts": 1}, max_retries=0)
    async with open_engines(config, tiny_model_dir, "0") as pool:
        (victim,) = server_pids(f"--port {pool.engines[0].url.rsplit(':', 1)[1]}")
        os.kill(victim, signal.SIGKILL)
        await pool.sync(_once(str(v1), "1"))
        assert pool.up == [True], pool.up  # back, and proved the new weights
        assert await pool.engines[0].weight_version() == "1"


async def test_the_sync_stops_the_run_only_when_no_engine_is_left(tiny_model_dir: Path) -> None:
    config = _config(
        tiny_model_dir, {"num_engines": 1, "max_restarts": 0}, max_retries=0, wait_for_up_s=1.0
    )
    async with open_engines(config, tiny_model_dir, "0") as pool:
        for engine in pool.engines:
            for pid in server_pids(f"--port {engine.url.rsplit(':', 1)[1]}"):
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception, match="failed on 1 of 1"):
            await pool.sync(_once(str(tiny_model_dir), "1"))
        with pytest.raises(EngineUnavailable, match="no engine .* is up after 1.0s"):
            await pool.sync(_once(str(tiny_model_dir), "2"))


PARENT = textwrap.dedent(
    """
    import sys, time
    from rollouts.engine.launch import engine_spec, start_engine_sync
    proc = start_engine_sync(engine_spec(sys.argv[1], max_batch=2))
    print(proc.process.pid, flush=True)
    time.sleep(600)
    """
)


def test_an_engine_dies_with_the_process_that_started_it(tiny_model_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.strip().isdigit(), line
        engine = int(line)
        assert engine in server_pids(str(tiny_model_dir))
    finally:
        parent.kill()  # SIGKILL: no cleanup code of the parent runs
        parent.wait(timeout=10)
    deadline = time.monotonic() + 20
    while engine in server_pids(str(tiny_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine not in server_pids(str(tiny_model_dir))


class _Stuck(http.server.BaseHTTPRequestHandler):
    """/health answers 200; every other request is accepted and never answered (30 s)."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        time.sleep(30)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


async def test_request_timeout_and_retries_reach_the_clients(tiny_model_dir: Path) -> None:
    """An external server that never answers: the configured 1 s bound holds (not 300 s)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stuck)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = _config(
            tiny_model_dir,
            kind="sglang",
            urls=[f"http://127.0.0.1:{server.server_address[1]}"],
            request_timeout_s=1.0,
            max_retries=0,
            wait_for_up_s=0.0,
        )
        with trio.fail_after(60), pytest.raises(BaseException) as info:
            async with open_engines(config, tiny_model_dir, "0"):
                pass
    finally:
        server.shutdown()
        server.server_close()
    messages = [str(e) for e in leaves(info.value)]
    assert any("no answer within 1.0s" in m for m in messages), messages


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]
