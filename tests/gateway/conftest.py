"""Fixtures of the gateway tests: one built-in engine server on the tiny model, and helpers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollouts.engine.launch import EngineProcess, engine_server_sync
from rollouts.inference.protocol import InferenceEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.wire.generation import Completion, SamplingParams


@pytest.fixture(scope="session")
def gateway_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny model with room for tools in the system message (char tokens)."""
    out = tmp_path_factory.mktemp("tiny-model-1k")
    spec = TinyModelSpec(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=1024,
        seed=0,
    )
    return make_tiny_model(out, spec)


@pytest.fixture(scope="session")
def server(gateway_model_dir: Path) -> Iterator[EngineProcess]:
    """One `rollouts serve` process for every gateway test module (session-scoped for the
    reason tests/rollout/conftest.py's `server` is)."""
    with engine_server_sync(gateway_model_dir, max_batch=16) as proc:
        yield proc


@pytest.fixture(scope="session")
def tok(gateway_model_dir: Path):
    return AutoTokenizer.from_pretrained(gateway_model_dir)


class Recording:
    """An engine that forwards to another and keeps every request and its completion."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.url = engine.url
        self.calls: list[tuple[str, tuple[int, ...], Completion]] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        completion = await self.engine.generate(input_ids, sampling, rid=rid)
        self.calls.append((rid or "", tuple(input_ids), completion))
        return completion

    async def abort(self, rid_prefix: str) -> None:
        await self.engine.abort(rid_prefix)

    def of(self, rid_prefix: str) -> list[tuple[tuple[int, ...], Completion]]:
        """The calls whose request id starts with `rid_prefix`, in order."""
        return [(ids, c) for rid, ids, c in self.calls if rid.startswith(rid_prefix)]
