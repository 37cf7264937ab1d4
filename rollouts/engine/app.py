"""Assembling the server: load the model, start the worker thread, serve the ASGI app.

Starlette app, served by hypercorn under trio. The worker thread (`EngineCore.run`) is started
from the same nursery with `trio.to_thread.run_sync`, so the event loop keeps answering while the
model runs; stopping the nursery stops the worker.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import hypercorn.config
import hypercorn.trio
import torch
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware

from rollouts.config.auto import attention
from rollouts.config.engine_options import EngineOptions
from rollouts.engine import (
    adapter_routes,
    dist_routes,
    http_util,
    openai_routes,
    precision,
    sglang_routes,
    sleep_routes,
)
from rollouts.engine.core import CoreOptions, EngineCore
from rollouts.engine.dist_weights import DistWeights
from rollouts.engine.state import ServerInfo, ServerState
from rollouts.gcpolicy import freeze_startup_objects

log = logging.getLogger(__name__)


def load_model(options: EngineOptions) -> tuple[Any, Any]:
    """The HF model (eval mode, on the device) and its tokenizer from `options.model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, "float32" if options.dtype == "auto" else options.dtype)
    attn = attention(options.attn_implementation, torch.device(options.device).type)
    model = AutoModelForCausalLM.from_pretrained(
        options.model, dtype=dtype, attn_implementation=attn
    )
    model = model.to(options.device).eval()
    if model.device.type == "cpu":  # own the memory: CPU tensors may map the files, which a
        with torch.no_grad():  # weight sync rewrites in place (weights/files.py `_recycle`)
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
    precision.mix(model, options.autocast)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    return model, tokenizer


def max_prompt_chars(tokenizer: Any, context_len: int, slack: int = 4) -> int:
    """Characters beyond which a text prompt can never fit `context_len` tokens.

    A token stands for at most as many characters as its vocabulary string has (byte-level and
    SentencePiece vocabularies alike), so a text of more than `context_len * longest` characters
    has more tokens than the context; `slack` covers normalizers that merge characters.
    """
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    assert context_len >= 1, f"{context_len=}"
    return slack * max(longest, 1) * context_len


def build_core(options: EngineOptions, model: Any, tokenizer: Any) -> tuple[EngineCore, ServerInfo]:
    """The engine core and the info the routes report, from a loaded model."""
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    context_len = int(getattr(model.config, "max_position_embeddings", 2048))
    core_options = CoreOptions(
        max_batch=options.max_batch,
        max_queue=options.max_queue,
        max_prefill=options.max_prefill,
        logprobs_from=options.logprobs_from,
        context_len=context_len,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        decode=options.decode,
        share_prefix=options.share_prefix,
        adapt_threads=options.adapt_threads,
    )
    info = ServerInfo(
        model_path=str(Path(options.model).resolve()),
        served_model_name=options.served_model_name or str(options.model),
        context_len=context_len,
        vocab_size=int(model.config.vocab_size),
        max_batch=options.max_batch,
        max_queue=options.max_queue,
        logprobs_from=options.logprobs_from,
        request_timeout_s=options.request_timeout_s,
        weights_roots=options.weights_roots,
        max_prompt_chars=max_prompt_chars(tokenizer, context_len),
        max_body_bytes=int(options.max_body_mb * 2**20),
    )
    core = EngineCore(
        model, tokenizer, core_options, options.weight_version, str(Path(options.model).resolve())
    )
    return core, info


def build_app(state: ServerState, api_key: str = "") -> Starlette:
    """The Starlette app with every route, JSON errors, and the API-key check if a key is set."""
    middleware = [Middleware(http_util.ReadBodyFirst, limit=state.info.max_body_bytes)]
    if api_key:
        middleware.append(Middleware(http_util.ApiKeyMiddleware, api_key=api_key))
    app = Starlette(
        routes=http_util.ROUTES
        + sglang_routes.ROUTES
        + openai_routes.ROUTES
        + dist_routes.ROUTES
        + adapter_routes.ROUTES
        + sleep_routes.ROUTES,
        middleware=middleware,
        exception_handlers=http_util.EXCEPTION_HANDLERS,
    )
    app.state.server = state
    app.state.dist_weights = DistWeights(state)
    return app


async def run_worker(core: EngineCore) -> None:
    """Run the core's loop in a thread until cancelled (then tell the loop to stop)."""
    try:
        await trio.to_thread.run_sync(core.run, abandon_on_cancel=True)
    finally:
        core.stop()


async def serve(options: EngineOptions, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, start the worker and the HTTP server; `started(url)` once it listens."""
    model, tokenizer = await trio.to_thread.run_sync(load_model, options)
    core, info = build_core(options, model, tokenizer)
    freeze_startup_objects()  # full collections then skip the model and the imports
    state = ServerState(core, info, trio.lowlevel.current_trio_token())
    config = hypercorn.config.Config()
    config.bind = [f"{options.host}:{options.port}"]
    config.accesslog = None
    config.keep_alive_timeout = 75
    never = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_worker, core)
        await nursery.start(
            functools.partial(
                hypercorn.trio.serve,
                build_app(state, options.api_key),
                config,
                shutdown_trigger=never.wait,
            )
        )
        url = f"http://{options.host}:{options.port}"
        log.info("rollouts engine server on %s (model %s)", url, options.model)
        log.info("decode steps: %s", core.decode_path)
        if options.autocast not in ("off", "auto"):
            log.info(
                "numerics: a %s autocast trainer's (linear weights %s, the rest float32)",
                options.autocast,
                options.autocast,
            )
        task_status.started(url)
