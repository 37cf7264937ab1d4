"""Real vLLM servers (vLLM's own CPU build) on 127.0.0.1, started together once per test run
(`tests/real_vllm/servers.py`: which four, and how CI starts them early for the run to adopt).

`scripts/test_vllm.sh` builds the vLLM environment and sets ROLLOUTS_VLLM_PYTHON; without it these
tests are skipped (the plain suite, `scripts/test.sh`, has no vLLM).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_vllm.servers import (
    START_TIMEOUT_S,
    VLLMServer,
    adopt_all,
    make_model_dirs,
    start_all,
)


def _started_earlier() -> Path | None:
    """The servers.json of servers started before this run (ROLLOUTS_VLLM_SERVERS), if any."""
    state = os.environ.get("ROLLOUTS_VLLM_SERVERS", "")
    if not state:
        return None
    assert Path(state).is_file(), f"ROLLOUTS_VLLM_SERVERS={state}: no such file"
    return Path(state)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("ROLLOUTS_VLLM_PYTHON", "")
    if not python or not Path(python).is_file():
        pytest.skip("real vLLM: run scripts/test_vllm.sh (it builds .venv-vllm)")
    return python


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    if (state := _started_earlier()) is not None:
        return {name: server.model for name, server in adopt_all(state).items()}
    return make_model_dirs(tmp_path_factory.mktemp("vllm-models"), smollm2_dir)


@pytest.fixture(scope="session")
def vllm(
    vllm_python: str, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VLLMServer]]:
    """The four servers: adopted (started earlier, at low priority) or started here."""
    started = time.monotonic()
    servers: dict[str, VLLMServer] = {}
    how = "started here"
    try:
        if (state := _started_earlier()) is not None:
            servers = adopt_all(state)
            try:
                for server in servers.values():
                    server.raise_priority()
                how = "started earlier"
            except PermissionError as e:  # a niced server would lose every core to the tests
                print(f"\n[vllm] cannot raise the early servers' priority ({e}): starting anew")
                for server in servers.values():
                    server.stop()
                servers = {}
        if not servers:
            servers = start_all(model_dirs, tmp_path_factory.mktemp("vllm-logs"))
        for server in servers.values():
            server.wait_ready(started + START_TIMEOUT_S)
        print(f"\n[vllm] 4 servers ({how}) ready in {time.monotonic() - started:.0f}s", flush=True)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
