"""Real engine servers for the inference tests, started together once per session (blocking
fixtures, since pytest-trio fixtures cannot outlive one test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollouts.engine.launch import EngineProcess, engine_spec, spawn, wait_healthy_sync

API_KEY = "test-key"


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path) -> Iterator[dict[str, EngineProcess]]:
    """Three servers on the tiny model, started in parallel: "main" (open), "keyed" (API key,
    small batch; the weight-reload test changes its weights and restores them), and "spare"
    (the pool test kills it)."""
    model = str(tiny_model_dir)
    procs = {
        "main": spawn(engine_spec(model, max_batch=8)),
        "keyed": spawn(engine_spec(model, max_batch=2, api_key=API_KEY)),
        "spare": spawn(engine_spec(model, max_batch=8)),
    }
    try:
        for proc in procs.values():
            wait_healthy_sync(proc, 120.0)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()
            proc.discard_log()
