"""LoRA adapter routes, as vLLM and SGLang answer them (the adapter is merged: `adapters.py`).

vLLM (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): POST /v1/load_lora_adapter {"lora_name",
"lora_path"} -> 200 with a plain-text "Success: ..." line; loading a name twice is a 400;
POST /v1/unload_lora_adapter {"lora_name"} -> 200, or 404 for a name it does not know. Requests
name the adapter in `model` (the answer echoes it; the served weights are the merged ones).
SGLang: POST /load_lora_adapter and /unload_lora_adapter with the same fields -> {"success",
"error_message", "loaded_adapters"} (400 with success false on a failure). /generate selects an
adapter with `lora_path` (its name).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollouts.engine.adapters import AdapterError
from rollouts.engine.http_util import error_json, json_body, state_of
from rollouts.engine.sampling import BadRequest
from rollouts.engine.state import ServerState, WeightPathForbidden
from rollouts.engine.weights import WeightLoadError


def _field(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(key, "must be a non-empty string")
    return value


async def _load_request(request: Request) -> tuple[ServerState, str, str]:
    """The server and the (lora_name, lora_path) of a load request (either API's)."""
    state = state_of(request)
    body = await json_body(request)
    return state, _field(body, "lora_name"), _field(body, "lora_path")


async def _unload_request(request: Request) -> tuple[ServerState, str]:
    """The server and the lora_name of an unload request (either API's)."""
    return state_of(request), _field(await json_body(request), "lora_name")


async def vllm_load(request: Request) -> Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"}."""
    state, name, path = await _load_request(request)
    try:
        await state.load_adapter(name, path)
    except AdapterError as exc:
        return error_json(400, str(exc), "InvalidUserInput", None)  # vLLM 0.32's answer
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: Request) -> Response:
    """POST /v1/unload_lora_adapter {"lora_name"}."""
    state, name = await _unload_request(request)
    try:
        await state.unload_adapter(name)
    except AdapterError as exc:
        return error_json(404, str(exc), "NotFoundError", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _sglang_answer(state: ServerState, error: str | None, status: int = 200) -> JSONResponse:
    loaded = dict(state.core.adapters.loaded)
    body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=status)


async def sglang_load(request: Request) -> Response:
    """POST /load_lora_adapter {"lora_name", "lora_path"}."""
    state, name, path = await _load_request(request)
    try:
        await state.load_adapter(name, path)
    except WeightPathForbidden as exc:
        return _sglang_answer(state, str(exc), 403)
    except (AdapterError, WeightLoadError) as exc:
        return _sglang_answer(state, str(exc), 400)
    return _sglang_answer(state, None)


async def sglang_unload(request: Request) -> Response:
    """POST /unload_lora_adapter {"lora_name"}."""
    state, name = await _unload_request(request)
    try:
        await state.unload_adapter(name)
    except AdapterError as exc:
        return _sglang_answer(state, str(exc), 400)
    return _sglang_answer(state, None)


ROUTES = [
    Route("/v1/load_lora_adapter", vllm_load, methods=["POST"]),
    Route("/v1/unload_lora_adapter", vllm_unload, methods=["POST"]),
    Route("/load_lora_adapter", sglang_load, methods=["POST"]),
    Route("/unload_lora_adapter", sglang_unload, methods=["POST"]),
]
