"""SGLang's distributed weight-update routes on the built-in server.

Same paths, request fields and answers as SGLang (`srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`, 0.5.21): `{"success": bool, "message": str}`, 200 or 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollouts.engine.dist_weights import DistWeights, GroupRequest, UpdateRefused
from rollouts.engine.http_util import json_body
from rollouts.engine.sampling import BadRequest
from rollouts.wire.weight_group import specs_from_request

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def dist_of(request: Request) -> DistWeights:
    return request.app.state.dist_weights


def answer(success: bool, message: str) -> Response:
    return JSONResponse(
        {"success": success, "message": message}, status_code=200 if success else 400
    )


def _required(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(key, f"is required ({kind.__name__})")
    return value


async def init_weights_update_group(request: Request) -> Response:
    """POST /init_weights_update_group: join the trainer's group; answers once it formed."""
    body = await json_body(request)
    try:
        req = GroupRequest(
            master_address=_required(body, "master_address", str),
            master_port=_required(body, "master_port", int),
            rank_offset=_required(body, "rank_offset", int),
            world_size=_required(body, "world_size", int),
            group_name=str(body.get("group_name") or DEFAULT_GROUP),
            backend=str(body.get("backend") or "nccl"),
        )
        await dist_of(request).init_group(req)
    except (UpdateRefused, RuntimeError, OSError, trio.TooSlowError) as exc:
        return answer(False, f"Failed to initialize custom process group: {exc}.")
    return answer(True, "Succeeded to initialize custom process group.")


async def destroy_weights_update_group(request: Request) -> Response:
    """POST /destroy_weights_update_group {"group_name": ...}."""
    body = await json_body(request, allow_empty=True)
    try:
        await dist_of(request).destroy_group(str(body.get("group_name") or DEFAULT_GROUP))
    except (UpdateRefused, RuntimeError) as exc:
        return answer(False, str(exc))
    return answer(True, "Succeeded to destroy custom process group.")


def _session_answer(step: Callable[[], None]) -> Response:
    """The answer to opening or closing the update session: a refusal is a failure."""
    try:
        step()
    except UpdateRefused as exc:
        return answer(False, str(exc))
    return answer(True, "Success")


async def begin_weight_update(request: Request) -> Response:
    """POST /begin_weight_update: open the session updates run in."""
    await json_body(request, allow_empty=True)
    return _session_answer(dist_of(request).begin)


async def end_weight_update(request: Request) -> Response:
    """POST /end_weight_update: close the session."""
    return _session_answer(dist_of(request).end)


async def update_weights_from_distributed(request: Request) -> Response:
    """POST /update_weights_from_distributed: receive one bucket from rank 0, load it."""
    body = await json_body(request)
    try:
        specs = specs_from_request(body.get("names"), body.get("dtypes"), body.get("shapes"))
    except (ValueError, AssertionError) as exc:
        raise BadRequest("names", str(exc)) from None
    version = body.get("weight_version")
    try:
        await dist_of(request).update(
            specs,
            group_name=str(body.get("group_name") or DEFAULT_GROUP),
            load_format=body.get("load_format"),
            version=None if version is None else str(version),
            flush_cache=bool(body.get("flush_cache", True)),
        )
    except (UpdateRefused, RuntimeError, trio.TooSlowError) as exc:
        return answer(False, f"Failed to update parameter online: {exc}")
    return answer(True, "Succeeded to update parameter online.")


ROUTES = [
    Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
    Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
    Route("/begin_weight_update", begin_weight_update, methods=["POST"]),
    Route("/end_weight_update", end_weight_update, methods=["POST"]),
    Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
]
