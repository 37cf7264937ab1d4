"""Building the engine clients of a run from `[engines]` config: the client of the kind
`engines.kind` names (`rollouts/engine_kinds.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from rollouts.config import EnginesConfig
from rollouts.engine_kinds import engine_kind
from rollouts.inference.http import HttpOptions
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import InferenceEngine, WeightReceiver
from rollouts.plugins import import_object


def http_options(config: EnginesConfig) -> HttpOptions:
    """Timeouts and retries of every client, from the config."""
    return HttpOptions(
        timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
        client_processes=config.client_processes,
    )


def make_engine(config: EnginesConfig, url: str) -> InferenceEngine:
    """One client of the engine kind's own class (`EngineKind.client`), on `url`."""
    kind = engine_kind(config.kind)
    client = import_object(kind.client)
    engine = client(url, api_key=config.api_key, options=http_options(config))
    assert isinstance(engine, InferenceEngine), f"{kind.client} is not an InferenceEngine"
    if isinstance(engine, WeightReceiver):  # the distributed sync sends on the kind's wire
        wire = kind.sync_wire.name
        assert engine.weight_wire == wire, f"{kind.client}: {engine.weight_wire=} != {wire!r}"
    return engine


def make_pool(config: EnginesConfig, urls: Sequence[str]) -> EnginePool:
    """An EnginePool over `urls` (the built-in engines' URLs, or `config.urls`)."""
    assert urls, "no engine URLs: start built-in engines first or set engines.urls"
    engines = [make_engine(config, url) for url in urls]
    return EnginePool(
        engines,
        health_interval_s=config.health_interval_s,
        wait_for_up_s=config.wait_for_up_s,
        stall_timeout_s=config.stall_timeout_s,
    )
