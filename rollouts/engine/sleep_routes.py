"""Sleep routes, as vLLM (dev mode) and SGLang answer them (the engine side: `sleep.py`).

vLLM: POST /sleep?level=0|1|2&mode=abort|wait|keep -> {"status": "sleeping", "level"};
POST /wake_up?tags=weights&tags=kv_cache&tags=scheduling (none: all) -> {"status": "awake" |
"sleeping", "tags"}; GET /is_sleeping -> {"is_sleeping"}. SGLang: POST
/release_memory_occupation and /resume_memory_occupation {"tags": [...] | null} (null or []:
all) -> 200 `null`; a release while requests run is refused (SGLang asserts the server idle,
waiting requests aside once generation is paused).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollouts.engine.http_util import error_json, json_body, state_of
from rollouts.engine.sampling import BadRequest
from rollouts.engine.sleep import TAGS

SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")


async def sleep(request: Request) -> Response:
    """POST /sleep?level=&mode=."""
    level_text = request.query_params.get("level", "1")
    if level_text not in ("0", "1", "2"):
        raise BadRequest("level", f"{level_text!r} must be 0, 1 or 2")
    mode = request.query_params.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise BadRequest("mode", f"{mode!r} must be one of ['abort', 'wait', 'keep']")
    await state_of(request).sleep(int(level_text), mode)
    return JSONResponse({"status": "sleeping", "level": int(level_text)})


async def wake_up(request: Request) -> Response:
    """POST /wake_up?tags=..."""
    tags = request.query_params.getlist("tags") or None
    unknown = sorted(set(tags or ()) - set(TAGS))
    if unknown:
        raise BadRequest("tags", f"{unknown} are not among {list(TAGS)}")
    awake = await state_of(request).wake_up(None if tags is None else set(tags))
    return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})


async def is_sleeping(request: Request) -> Response:
    return JSONResponse({"is_sleeping": state_of(request).core.sleep.asleep})


async def _sglang_tags(request: Request) -> set[str]:
    body = await json_body(request, allow_empty=True)
    tags = body.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
    ):
        raise BadRequest("tags", "must be a list of strings, or null for all")
    unknown = sorted(set(tags or ()) - set(SGLANG_TAGS))
    if unknown:
        raise BadRequest("tags", f"{unknown} are not among {list(SGLANG_TAGS)}")
    return set(tags or SGLANG_TAGS) - {"cuda_graph"}  # no CUDA graphs here


async def release_memory_occupation(request: Request) -> Response:
    """POST /release_memory_occupation {"tags"}: only on an idle server (or a paused one)."""
    state = state_of(request)
    tags = await _sglang_tags(request)
    running, waiting = state.core.load()
    if running or (waiting and not state.core.paused):
        message = "release_memory_occupation should be called only when server is idle."
        return error_json(400, message, "BadRequestError")
    await state.command(lambda reply: reply(state.core.release(tags, keep_weights=False)))
    return JSONResponse(None)


async def resume_memory_occupation(request: Request) -> Response:
    """POST /resume_memory_occupation {"tags"}."""
    state = state_of(request)
    tags = await _sglang_tags(request)
    await state.wake_up(tags)
    return JSONResponse(None)


ROUTES = [
    Route("/sleep", sleep, methods=["POST"]),
    Route("/wake_up", wake_up, methods=["POST"]),
    Route("/is_sleeping", is_sleeping, methods=["GET"]),
    Route("/release_memory_occupation", release_memory_occupation, methods=["GET", "POST"]),
    Route("/resume_memory_occupation", resume_memory_occupation, methods=["GET", "POST"]),
]
