"""The gateway's HTTP server: one per run, sessions keyed by an unguessable token in the URL.

`open_gateway` serves a Starlette app with hypercorn under trio (as the built-in engine server
does) on 127.0.0.1 and a free port, started with `nursery.start`, and yields the `Gateway`: the
table of open sessions. A sample's session lives at `http://127.0.0.1:PORT/s/<token>/v1`
(`Gateway.open`), the token 128 random bits; `/v1/chat/completions` and `/v1/models` answer
there. A finished or unknown session is a 404. Sessions share nothing but this table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollouts.gateway.calls import Session, chat
from rollouts.gateway.session import Ending
from rollouts.gateway.wire import GatewayError
from rollouts.rollout.protocol import GenerateContext

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 * 2**20
SERVED_MODEL = "rollouts-policy"  # what /v1/models lists; the gateway serves the run's policy


class Gateway:
    """The open sessions of a running gateway, by token (see the module docstring)."""

    def __init__(self, url: str) -> None:
        assert url.startswith("http://"), f"{url=}"
        self.url = url
        self.sessions: dict[str, Session] = {}

    @contextlib.contextmanager
    def open(
        self, ctx: GenerateContext, max_calls: int, call_timeout_s: float
    ) -> Iterator[Session]:
        """A session for one sample, closed (its URL a 404) when the block ends."""
        token = secrets.token_urlsafe(16)
        assert token not in self.sessions, "a session token was drawn twice"
        session = Session(token=token, ctx=ctx, max_calls=max_calls, call_timeout_s=call_timeout_s)
        self.sessions[token] = session
        try:
            yield session
        finally:
            del self.sessions[token]

    def base_url(self, session: Session) -> str:
        """The OpenAI base_url a sample's agent is given."""
        return f"{self.url}/s/{session.token}/v1"

    def session_of(self, request: Request) -> Session:
        """The request's session, or a 404."""
        session = self.sessions.get(request.path_params["token"])
        if session is None:
            raise GatewayError(
                404,
                "no open session at this base_url: the sample's episode has ended (its agent "
                "returned), or the URL is not one the gateway gave",
                code="session_not_found",
            )
        return session


def _error(e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request) -> Any:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise GatewayError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise GatewayError(400, f"the body is not JSON: {e}") from e


async def chat_completions(request: Request) -> Response:
    """POST /s/{token}/v1/chat/completions."""
    gateway: Gateway = request.app.state.gateway
    try:
        session = gateway.session_of(request)
        body = await _body(request)
    except GatewayError as e:
        return _error(e)
    try:
        return JSONResponse(await chat(session, body))
    except GatewayError as e:
        return _error(e)
    except Exception as e:  # a template or tokenizer failure: the sample fails, saying why
        log.exception("gateway call failed")
        reason = f"the gateway failed the call: {type(e).__name__}: {e}"
        session.episode.end(Ending.FAILED, reason)
        return _error(GatewayError(500, reason))


async def models(request: Request) -> Response:
    """GET /s/{token}/v1/models: the one model behind the session (what SDKs list)."""
    gateway: Gateway = request.app.state.gateway
    try:
        gateway.session_of(request)
    except GatewayError as e:
        return _error(e)
    card = {"id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "rollouts"}
    return JSONResponse({"object": "list", "data": [card]})


def build_app(gateway: Gateway) -> Starlette:
    """The Starlette app of `gateway`'s routes."""
    app = Starlette(
        routes=[
            Route("/s/{token}/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/s/{token}/v1/models", models, methods=["GET"]),
        ]
    )
    app.state.gateway = gateway
    return app


async def _serve(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.keep_alive_timeout = 75
    gateway = Gateway("http://127.0.0.1:0")  # its url is known once the socket is bound
    never = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(
                hypercorn.trio.serve, build_app(gateway), config, shutdown_trigger=never.wait
            )
        )
        gateway.url = binds[0]
        log.info("OpenAI-compatible gateway on %s", gateway.url)
        task_status.started(gateway)


@contextlib.asynccontextmanager
async def open_gateway() -> AsyncIterator[Gateway]:
    """Serve the gateway for the block's lifetime (stopped when it ends)."""
    async with trio.open_nursery() as nursery:
        gateway = await nursery.start(_serve)
        try:
            yield gateway
        finally:
            nursery.cancel_scope.cancel()
