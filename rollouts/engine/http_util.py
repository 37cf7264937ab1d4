"""HTTP plumbing shared by the routes: JSON bodies, errors as JSON, the API-key check, health."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollouts.engine.sampling import BadRequest, SamplingSpec
from rollouts.engine.sleep import AsleepError
from rollouts.engine.state import ServerState, ServiceUnavailable, WeightPathForbidden
from rollouts.engine.weights import WeightLoadError

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)  # reachable without the API key
HEALTH_GENERATE_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1  # the Retry-After of a 503: the queue drains or a pause ends
BIG_BODY = 2**20  # bytes: parse a larger JSON body in a thread
T = TypeVar("T")


class PayloadTooLarge(ValueError):
    """A request body over `--max-body-mb`: HTTP 413."""


def state_of(request: Request) -> ServerState:
    """The server state stored on the app."""
    return request.app.state.server


def error_json(
    status: int, message: str, error_type: str, param: str | None = None
) -> JSONResponse:
    """The error shape both SGLang and vLLM clients read: {"error": {"message", "type", ...}}."""
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or PayloadTooLarge as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"the body has {declared} bytes; the limit is {limit} (--max-body-mb)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes (--max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it (413 when
    it is larger than the server takes)."""
    raw = await read_body(request, state_of(request).info.max_body_bytes)
    if not raw.strip() and allow_empty:
        return {}
    try:  # a large body is parsed in a thread, so the event loop keeps serving
        if len(raw) > BIG_BODY:
            body = await trio.to_thread.run_sync(json.loads, raw)
        else:
            body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest("body", f"malformed JSON ({exc})") from None
    except RecursionError:
        raise BadRequest("body", "the JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


async def on_bad_request(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest), f"{exc!r}"
    return error_json(400, str(exc), "BadRequestError", exc.field)


async def on_unavailable(_request: Request, exc: Exception) -> Response:
    response = error_json(503, str(exc), "ServiceUnavailableError")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def on_too_large(_request: Request, exc: Exception) -> Response:
    return error_json(413, str(exc), "PayloadTooLargeError")


async def on_weight_error(_request: Request, exc: Exception) -> Response:
    if isinstance(exc, WeightPathForbidden):
        return error_json(403, str(exc), "PermissionDeniedError", "model_path")
    return error_json(400, str(exc), "BadRequestError", "model_path")


async def on_timeout(_request: Request, exc: Exception) -> Response:
    return error_json(504, f"the request did not finish in time ({exc!r})", "TimeoutError")


async def on_client_gone(request: Request, _exc: Exception) -> Response:
    """The client closed the connection before its body arrived (a caller that stopped waiting,
    say an abort it timed out): nothing to answer, and no server error. 499 is nginx's code for
    it; nobody receives it."""
    log.info("%s %s: the client left before its request was read", request.method, request.url.path)
    return Response(status_code=499)


async def on_crash(_request: Request, exc: Exception) -> Response:
    log.error("unhandled error in a route", exc_info=exc)
    return error_json(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")


EXCEPTION_HANDLERS = {
    Exception: on_crash,
    ClientDisconnect: on_client_gone,
    BadRequest: on_bad_request,
    ServiceUnavailable: on_unavailable,
    AsleepError: on_unavailable,
    PayloadTooLarge: on_too_large,
    WeightLoadError: on_weight_error,
    trio.TooSlowError: on_timeout,
}


async def unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T | None:
    """`await fn()`, cancelled when the client disconnects first (then None): the work of a
    client that is gone (its generating rows) stops instead of running to the end."""
    result: list[T] = []

    async def watch(scope: trio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client of %s disconnected; aborting its request", request.url.path)
        scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            result.append(await fn())
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # fn's own error (400, 503, 504) reaches its handler
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return result[0] if result else None


class ReadBodyFirst:
    """Reads the rest of a request's body before its answer goes out, when the route did not.

    HTTP/1.1 keep-alive needs it. hypercorn closes a connection whose answer ended before the
    request's body arrived (h11 cannot start the next cycle), and the client's next request on
    that pooled connection fails with "Server disconnected without sending a response". Routes
    that ignore their body (`/end_weight_update`, `/continue_generation`, `/pause`, ...) raced
    the body's second TCP segment. uvicorn, which SGLang and vLLM run on, waits for the body;
    so does this. A body over `limit` bytes is left unread (that connection closes, as after a
    413), and a client that left is not waited for.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        done, seen = False, 0  # the whole body received (or the client left); its bytes

        async def tracked() -> Message:
            nonlocal done, seen
            message = await receive()
            seen += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        async def send_after_body(message: Message) -> None:
            if message["type"] == "http.response.start":
                while not done and seen <= self.limit:
                    await tracked()
            await send(message)

        await self.app(scope, tracked, send_after_body)


class ApiKeyMiddleware:
    """With an API key set, every route but /health needs `Authorization: Bearer <key>` (401)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.expected:
                response = error_json(401, "missing or wrong API key", "AuthenticationError")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def health(_request: Request) -> Response:
    """GET /health: 200 once the server answers."""
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """GET /health_generate: 200 if a one-token generation completes, else 503."""
    state = state_of(request)
    spec = SamplingSpec(max_new_tokens=1, temperature=0.0)
    try:
        with trio.fail_after(HEALTH_GENERATE_TIMEOUT_S):
            await state.generate([0], spec, state.new_rid(), 1)
    except (ServiceUnavailable, trio.TooSlowError) as exc:
        return error_json(503, f"generation is not healthy: {exc}", "ServiceUnavailableError")
    return Response(status_code=200)


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/health_generate", health_generate, methods=["GET"]),
]
