"""The engine kinds' registry: each kind builds its own client, and the config refuses a kind
that is not in it, naming the key and the kinds there are."""

from __future__ import annotations

import pytest

from rollouts.config import ConfigError, EnginesConfig, config_from_dict
from rollouts.config.rollout import engine_logprobs, resolved_concurrency
from rollouts.engine_kinds import ENGINE_KINDS
from rollouts.inference.factory import make_engine
from rollouts.inference.protocol import InferenceEngine, WeightReceiver


@pytest.mark.parametrize("name", sorted(ENGINE_KINDS))
async def test_each_kind_builds_its_client_on_its_wire(name: str) -> None:
    kind = ENGINE_KINDS[name]
    urls = [] if kind.started_here else ["http://127.0.0.1:1"]
    engine = make_engine(EnginesConfig(kind=name, urls=urls), "http://127.0.0.1:1")
    try:
        assert isinstance(engine, InferenceEngine), type(engine)
        assert engine.url == "http://127.0.0.1:1", engine.url
        assert isinstance(engine, WeightReceiver), type(engine)
        assert engine.weight_wire == kind.sync_wire.name, (engine.weight_wire, kind.sync_wire)
    finally:
        await engine.aclose()


def test_an_unknown_kind_is_refused_at_load_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"engines": {"kind": "no-such-engine", "urls": ["http://h:1"]}})
    text = str(caught.value)
    assert "engines.kind = 'no-such-engine'" in text, text
    assert all(repr(name) in text for name in ENGINE_KINDS), text


def test_what_the_record_says_the_config_asks() -> None:
    """Started here: [engines.builtin] says the logprobs and the capacity; else the servers'
    defaults (SGLang's scaled, vLLM's raw) and 64 requests in flight."""
    builtin = config_from_dict({"engines": {"builtin": {"num_engines": 2, "max_batch": 8}}})
    assert engine_logprobs(builtin.engines) == "raw"
    assert resolved_concurrency(builtin.rollout, builtin.engines) == 16
    for name, logprobs in (("sglang", "scaled"), ("vllm", "raw")):
        config = config_from_dict({"engines": {"kind": name, "urls": ["http://h:1"]}})
        assert engine_logprobs(config.engines) == logprobs, name
        assert resolved_concurrency(config.rollout, config.engines) == 64, name
