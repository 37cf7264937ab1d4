"""Engines for a run: built-in `rollouts serve` processes, or running SGLang / vLLM servers.

Either way the loop gets one `EnginePool` (an InferenceEngine) with periodic health checks.
Built-in engines are started on the given model with the given weight version and stopped when
the block exits (also on Ctrl-C or an error); external servers are first made to serve the
run's starting weights with a weight sync.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from rollouts.config import Config
from rollouts.inference.launch import serve_engines
from rollouts.inference.pool import EnginePool
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.training.weight_sync import sync_weights_to_engines


@contextlib.asynccontextmanager
async def open_engines(config: Config, model_dir: Path, version: str) -> AsyncIterator[EnginePool]:
    """An EnginePool over built-in engine processes (started here, stopped on exit) or URLs."""
    e = config.engines
    async with trio.open_nursery() as nursery:
        if e.kind == "builtin":
            urls = await nursery.start(
                functools.partial(
                    serve_engines,
                    model_dir,
                    e.num_engines,
                    api_key=e.api_key,
                    max_batch=e.max_batch,
                    max_queue=e.max_queue,
                    logprobs_from=e.logprobs_from,
                    device=e.device,
                    weight_version=version,
                    startup_timeout_s=e.startup_timeout_s,
                )
            )
            client = SGLangEngine
        else:
            urls = list(e.urls)
            client = SGLangEngine if e.kind == "sglang" else VLLMEngine
        pool = EnginePool(
            [client(u, api_key=e.api_key) for u in urls], health_interval_s=e.health_interval_s
        )
        try:
            if e.kind != "builtin":  # external servers: make them serve our starting weights
                await sync_weights_to_engines(pool.engines, str(model_dir), version)
            await nursery.start(pool.run_health_checks)
            yield pool
        finally:
            await pool.aclose()
            nursery.cancel_scope.cancel()
