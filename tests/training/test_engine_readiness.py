"""Servers the user started are waited for (engines.startup_timeout_s), naming the URLs still
loading: a run pointed at a server that starts late waits, then trains."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollouts.engine.launch import engine_spec, spawn
from rollouts.inference.http import EngineUnavailable
from rollouts.inference.readiness import wait_until_ready
from rollouts.inference.sglang import SGLangEngine
from rollouts.wire.ports import free_port
from tests import programs

from .test_train_e2e import ROOT, TRAIN, _config, _steps

WAITING = "waiting for 1 of 1 server(s) to answer /health"


async def test_wait_names_the_urls_still_loading_then_gives_up() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = SGLangEngine(url)
    lines: list[str] = []
    with pytest.raises(EngineUnavailable, match=r"engines.startup_timeout_s = 1\.5: .*" + url):
        await wait_until_ready([engine], 1.5, report=lines.append, poll_s=0.1, report_every_s=0.5)
    assert lines and all(line.endswith(url) for line in lines)
    assert "waiting for 1 of 1 server(s)" in lines[0]
    await engine.aclose()


def test_a_run_pointed_at_a_late_server_waits_then_trains(tmp_path: Path) -> None:
    port = free_port()
    config = _config(
        tmp_path,
        training={"rl_steps": 1},
        engines={"kind": "sglang", "urls": [f"http://127.0.0.1:{port}"], "startup_timeout_s": 120},
    )
    cmd = [sys.executable, str(TRAIN), "--mode", "rl", "--config", str(config)]
    log = tmp_path / "train.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the waiting line reaches the log at once
    with log.open("w") as out:
        run = programs.popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = None
    try:
        base = tmp_path / "base" / "config.json"  # the run builds its tiny base model first
        deadline = time.monotonic() + 120
        # the server starts once the run says it waits for it (polled, not a fixed sleep)
        while WAITING not in log.read_text() and run.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert base.is_file(), log.read_text()[-3000:]
        assert run.poll() is None, log.read_text()[-3000:]
        server = spawn(engine_spec(str(base.parent), port=port, torch_threads=1))
        assert run.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server is not None:
            server.stop()
            server.discard_log()
    text = log.read_text()
    assert WAITING in text, text[-3000:]
    ready = f"[engines] http://127.0.0.1:{port} ready after"
    assert any(
        line.startswith(ready) and line.endswith("rollouts built-in server")
        for line in text.splitlines()
    ), text[-3000:]
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [0, 1]
