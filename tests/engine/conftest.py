"""Engine servers for the fault tests, started together once per session (a blocking fixture,
since pytest-trio fixtures cannot outlive one test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollouts.engine.launch import engine_spec, spawn, wait_healthy_sync


@pytest.fixture(scope="session")
def fault_servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Two servers for the fault tests, started in parallel: "rooted" (reloads only from inside
    its `--weights-root`, `fault_servers["rooted"].root`), and "short" (2 s request timeout, a
    queue of 4, 1 MB bodies)."""
    root = tmp_path_factory.mktemp("weights-root")
    model = str(tiny_model_dir)
    procs = {
        "rooted": spawn(engine_spec(model, max_batch=4, weights_roots=(str(root),))),
        "short": spawn(
            engine_spec(model, max_batch=2, max_queue=4, request_timeout_s=2.0, max_body_mb=1.0)
        ),
    }
    try:
        for proc in procs.values():
            wait_healthy_sync(proc, 120.0)
        yield {**procs, "root": root}
    finally:
        for proc in procs.values():
            proc.stop()
            proc.discard_log()
