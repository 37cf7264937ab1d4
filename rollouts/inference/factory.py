"""Building the engine clients of a run from `[engines]` config."""

from __future__ import annotations

from collections.abc import Sequence

from rollouts.config import EnginesConfig
from rollouts.inference.http import HttpOptions
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import InferenceEngine
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine


def http_options(config: EnginesConfig) -> HttpOptions:
    """Timeouts and retries of every client, from the config."""
    return HttpOptions(timeout_s=config.request_timeout_s, max_retries=config.max_retries)


def make_engine(config: EnginesConfig, url: str) -> InferenceEngine:
    """One client: vLLM's API for kind "vllm", SGLang's (also the built-in server's) otherwise."""
    options = http_options(config)
    if config.kind == "vllm":
        return VLLMEngine(url, api_key=config.api_key, options=options)
    return SGLangEngine(url, api_key=config.api_key, options=options)


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
