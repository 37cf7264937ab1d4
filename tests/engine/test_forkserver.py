"""The engine forkserver (`rollouts/engine/forkserver.py`): a forked engine is the engine a fresh
process starts (the same tokens and logprobs, greedy and seeded; its command line, log and exit
status), it is refused where its imports would differ, and it dies with its launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollouts.engine.forkserver import ENV_VAR, ForkedProcess, fork_engine, start_server
from rollouts.engine.launch import (
    EngineProcess,
    EngineStartError,
    engine_env,
    engine_spec,
    server_command,
    spawn,
    start_engine_sync,
)


@pytest.fixture(scope="module")
def forkserver() -> Iterator[tuple[subprocess.Popen, Path]]:
    """A forkserver of this module's own (the suite's may be off): its process and folder."""
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-fs-test-"))
    server = start_server(str(tmp / "engines.sock"), engine_env(), str(tmp / "forkserver.log"))
    try:
        yield server, tmp
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def forked(forkserver: tuple[subprocess.Popen, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """Engines started in this test are asked of the module's forkserver; its folder."""
    monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
    return forkserver[1]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _generate(proc: EngineProcess, **sampling: object) -> dict:
    body = {
        "input_ids": [5, 9, 13, 2],
        "sampling_params": {"max_new_tokens": 12, **sampling},
        "return_logprob": True,
    }
    reply = httpx.post(f"{proc.url}/generate", json=body, timeout=30.0)
    reply.raise_for_status()
    meta = reply.json()["meta_info"]
    return {"ids": reply.json()["output_ids"], "logprobs": meta["output_token_logprobs"]}


def test_a_forked_engine_serves_what_a_fresh_one_serves(
    tiny_model_dir: Path, forkserver: tuple[subprocess.Popen, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    asks = [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7, "top_k": 20}]
    outputs, the_spec = {}, engine_spec(tiny_model_dir, max_batch=2)
    for how in ("fresh", "forked"):
        if how == "forked":
            monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
        else:
            monkeypatch.delenv(ENV_VAR, raising=False)
        proc = start_engine_sync(the_spec)
        try:
            parent = forkserver[0].pid if how == "forked" else os.getpid()
            assert isinstance(proc.process, ForkedProcess) == (how == "forked")
            assert _parent(proc.process.pid) == parent, how
            outputs[how] = [_generate(proc, **ask) for ask in asks]
            port = int(proc.url.rsplit(":", 1)[1])
            cmdline = Path(f"/proc/{proc.process.pid}/cmdline").read_bytes().rstrip(b"\0")
            assert cmdline.split(b"\0") == [a.encode() for a in server_command(the_spec, port)]
        finally:
            proc.stop()
        assert proc.process.returncode == -signal.SIGTERM, how
        assert "rollouts engine server on" in proc.log_tail(), how
    assert outputs["forked"] == outputs["fresh"]
    assert outputs["fresh"][0]["ids"] != outputs["fresh"][1]["ids"]  # the two asks differ


def test_a_forked_engine_reports_its_exit_and_takes_signals_by_pid(
    tiny_model_dir: Path, forked: Path
) -> None:
    with pytest.raises(EngineStartError, match=r"exited with 2 at start:\n.*--cpus '4096'"):
        start_engine_sync(engine_spec(tiny_model_dir, extra_args=["--cpus", "4096"]))
    proc = start_engine_sync(engine_spec(tiny_model_dir))
    assert isinstance(proc.process, ForkedProcess)
    os.kill(proc.process.pid, signal.SIGSTOP)  # as the hung-engine tests do
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{proc.url}/health", timeout=1.0)
    assert proc.process.poll() is None
    os.kill(proc.process.pid, signal.SIGCONT)
    assert httpx.get(f"{proc.url}/health", timeout=10.0).status_code == 200
    proc.kill()
    assert proc.process.returncode == -signal.SIGKILL
    proc.kill()  # again: a no-op, not a signal to a reused pid


def test_an_environment_its_imports_would_read_differently_starts_a_fresh_process(
    tiny_model_dir: Path, forked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    proc = spawn(engine_spec(tiny_model_dir))
    try:
        assert isinstance(proc.process, subprocess.Popen)
        assert _parent(proc.process.pid) == os.getpid()
    finally:
        proc.kill()
    log = (forked / "forkserver.log").read_text()
    assert "refused: the environment differs in ['OMP_NUM_THREADS'], read at import time" in log


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from rollouts.engine.launch import engine_spec, start_engine_sync
    proc = start_engine_sync(engine_spec(sys.argv[1], max_batch=2))
    print(type(proc.process).__name__, proc.process.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_forked_engine_dies_with_its_launcher(tiny_model_dir: Path, forked: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        kind, pid = (launcher.stdout.readline() if launcher.stdout else "").split()
        assert kind == "ForkedProcess"
        assert Path(f"/proc/{pid}").exists()
    finally:
        launcher.kill()  # SIGKILL: no clean-up of its own runs
        launcher.wait(timeout=10)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed by the forkserver, then reaped by it
    assert not Path(f"/proc/{pid}").exists()


def test_a_server_that_is_not_there_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = [sys.executable, "-m", "rollouts.engine", "--model", "m"]
    missing = str(tmp_path / "no-server.sock")
    with caplog.at_level("WARNING", logger="rollouts.engine.forkserver"):
        for _ in range(2):
            assert fork_engine(argv, dict(os.environ), str(tmp_path / "log"), missing) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"engine forkserver {missing}: "), said
    assert said[0].endswith("engines start fresh"), said
