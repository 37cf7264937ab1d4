"""Fixtures shared by the rollout tests that drive a real built-in engine server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.engine.launch import EngineProcess, engine_server_sync
from rollouts.inference.sglang import SGLangEngine


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """One `rollouts serve` process on a free loopback port for every rollout test module.
    Session-scoped, not package-scoped: an xdist worker runs the rollout files between others'
    (--dist loadfile), and a package fixture is stopped whenever the next test is outside the
    package, then started again (about 9 s each on 2 cores)."""
    with engine_server_sync(tiny_model_dir, max_batch=32) as proc:
        yield proc


@pytest.fixture(scope="session")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def engine(server: EngineProcess) -> AsyncIterator[SGLangEngine]:
    """A client of the shared server (SGLang's routes), closed after the test."""
    client = SGLangEngine(server.url)
    try:
        yield client
    finally:
        await client.aclose()
