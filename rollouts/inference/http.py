"""The HTTP layer of the engine clients: bounded calls, bounded retries, errors that say why.

httpx.AsyncClient under trio, two pools per engine: generation requests (`GENERATION_PATHS`) in
one sized for a whole rollout batch, every other call (pause, resume, weight reload, abort,
health, loads) in its own small one, so a control call never queues behind generations it is
meant to pause (a keep-mode pause of a full pool would otherwise wait for them forever: a
deadlock until the timeout). Every call is inside `trio.fail_after`. Connection failures (and
503, the server saying "not now") are retried with bounded exponential backoff; a 4xx is never
retried and is raised with the server's message.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
from collections.abc import Callable
from typing import Any, TypedDict

import httpx
import orjson
import trio

from rollouts.gcpolicy import gc_paused
from rollouts.inference.client_procs import Call, client_processes
from rollouts.wire.tls import tls_context


class EngineError(RuntimeError):
    """An engine call failed."""


class EngineRequestError(EngineError):
    """The engine refused the request (4xx, or another non-retryable status): not retried."""

    def __init__(self, status: int, message: str, url: str) -> None:
        self.status, self.message, self.url = status, message, url
        super().__init__(f"{url}: HTTP {status}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:  # from an engine client process (`client_procs`)
        return (type(self), (self.status, self.message, self.url))


class EngineUnavailable(EngineError):
    """The engine could not be reached (or kept answering 503) after the bounded retries."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HttpOptions:
    """Timeouts, retries and pool size of one client."""

    timeout_s: float = 300.0  # whole call, generation included
    connect_timeout_s: float = 5.0
    max_retries: int = 3
    backoff_s: float = 0.1  # first retry delay; doubles each retry
    max_backoff_s: float = 2.0
    max_connections: int = 256  # generation requests in flight (rollout.max_concurrency bounds)
    max_control_connections: int = 4  # pause / resume / reload / abort / health / loads
    # generation calls (request and decode) in this many worker processes (`client_procs.py`);
    # 0: in this process
    client_processes: int = 0

    def __post_init__(self) -> None:
        assert self.timeout_s > 0, f"{self.timeout_s=}"
        assert self.max_retries >= 0, f"{self.max_retries=}"
        assert 1 <= self.max_connections <= 1024, f"{self.max_connections=}"
        assert 1 <= self.max_control_connections <= 64, f"{self.max_control_connections=}"
        assert 0 <= self.client_processes <= 64, f"{self.client_processes=}"


GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
SHARD_CONNECTIONS = 16
# an idle connection is dropped after this, before the server drops it: uvicorn (SGLang, vLLM)
# closes idle ones after 5 s, httpx's default; a request sent on one the server is closing
# fails with "Server disconnected without sending a response"
KEEPALIVE_S = 2.0


def shard_sizes(connections: int, per_shard: int) -> list[int]:
    """Connection limits of the generation shards: `connections` in all, each <= per_shard."""
    assert connections >= 1, f"{connections=}"
    assert per_shard >= 1, f"{per_shard=}"
    full, rest = divmod(connections, per_shard)
    return [per_shard] * full + ([rest] if rest else [])


def backoff_delays(options: HttpOptions) -> list[float]:
    """The delays before each retry: exponential, capped, `max_retries` of them."""
    return [
        min(options.backoff_s * 2**i, options.max_backoff_s) for i in range(options.max_retries)
    ]


def loads(content: bytes) -> Any:
    """A JSON body decoded: orjson (3x the standard library's speed on an answer of per-token
    lists, the same floats), and what it refuses (NaN, integers past 64 bits, a UTF-16 body)
    decoded by `json.loads` as before, or its error raised."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return json.loads(content)


JSON_HEADERS = {"Content-Type": "application/json"}


def dumps(body: Any) -> bytes:
    """A request's JSON body: orjson (a group's request repeats its prompt's ids per sample:
    10x the standard library's speed), and what it refuses (a non-string key, a type of its
    own) as httpx encodes `json=`: the standard library's bytes, or its error. orjson writes
    NaN as null; no body carries one (the config refuses NaN sampling values)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")


def error_message(response: httpx.Response) -> str:
    """The server's error message: {"error": {"message"}}, {"message"}, {"detail"} or the text."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:2000] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]


class EngineHttpArgs(TypedDict, total=False):
    """`EngineHttp`'s keyword arguments, which an engine client takes and hands on to it."""

    api_key: str
    options: HttpOptions | None
    transport: httpx.AsyncBaseTransport | None


class EngineHttp:
    """One engine's HTTP client (base URL, API key, retries)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str = "",
        options: HttpOptions | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.options = options or HttpOptions()
        self._api_key = api_key
        # a custom transport (tests' fault injection) is in this process: its calls stay here
        self._workers = (
            client_processes(self.options.client_processes)
            if self.options.client_processes and transport is None
            else None
        )
        self._worker_options = dataclasses.replace(self.options, client_processes=0)  # theirs
        o = self.options
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        def client(connections: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(o.timeout_s, connect=o.connect_timeout_s),
                limits=httpx.Limits(
                    max_connections=connections,
                    max_keepalive_connections=connections,
                    keepalive_expiry=KEEPALIVE_S,
                ),
                verify=tls_context(),
                transport=transport,
            )

        # generation: shards of <= SHARD_CONNECTIONS, taken in turn (httpcore scans every
        # connection of a pool for every queued request: one big pool costs the driver whole
        # seconds of CPU per 128-request batch, contending with the trainer in async mode)
        sizes = shard_sizes(o.max_connections, SHARD_CONNECTIONS)
        self._shards = [client(n) for n in sizes]
        self._turn = itertools.count()
        self._control = client(o.max_control_connections)  # everything else

    def _pool(self, path: str) -> httpx.AsyncClient:
        if path not in GENERATION_PATHS:
            return self._control
        return self._shards[next(self._turn) % len(self._shards)]

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """One request with retries; returns the 2xx response or raises an EngineError.
        `content`: a JSON body already encoded (`json_body` encoded once, not per retry)."""
        timeout_s = timeout_s or self.options.timeout_s
        if json_body is not None:
            content = dumps(json_body)
        headers = None if content is None else JSON_HEADERS
        delays = [*backoff_delays(self.options), None]
        last = ""
        for delay in delays:
            # a task cancelled since its last checkpoint (e.g. handed a lock as its owner
            # closes the clients) stops here, not on a closed client's RuntimeError
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                with trio.fail_after(timeout_s):
                    response = await self._pool(path).request(
                        method, path, content=content, headers=headers, params=params
                    )
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            except trio.TooSlowError:
                raise EngineUnavailable(
                    f"{self.url}{path}: no answer within {timeout_s}s"
                ) from None
            else:
                if response.status_code < 300:
                    return response
                if response.status_code != 503:
                    raise EngineRequestError(
                        response.status_code, error_message(response), self.url
                    )
                last = f"HTTP 503: {error_message(response)}"
            if delay is not None:
                await trio.sleep(delay)
        raise EngineUnavailable(
            f"{self.url}{path}: failed after {self.options.max_retries} retries ({last})"
        )

    async def json(
        self,
        method: str,
        path: str,
        *,
        read: Callable[[Any], Any] | None = None,
        decode: Callable[[bytes], Any] = loads,
        **kwargs: Any,
    ) -> Any:
        """`call`, then the body as JSON by `decode` (an EngineError if it is not JSON), and
        `read` of it when given: both with the cyclic collector paused (`gcpolicy.gc_paused`),
        so a large answer's temporaries are gone before it runs again. A generation call with no
        `read` and a picklable `decode` runs in a worker process when `client_processes` is set."""
        if self._workers is not None and read is None and path in GENERATION_PATHS:
            call = self._worker_call(method, path, decode, kwargs)
            if call is not None:
                return await self._workers.call(call)
        response = await self.call(method, path, **kwargs)
        with gc_paused():
            try:
                body = decode(response.content)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise EngineError(
                    f"{self.url}{path}: answer is not JSON: {response.text[:200]!r}"
                ) from None
            if read is None:
                return body
            out = read(body)
            del body  # freed before the collector is back on: never counted toward a collection
        return out

    def _worker_call(
        self, method: str, path: str, decode: Callable[[bytes], Any], kwargs: dict[str, Any]
    ) -> Call | None:
        """The call a worker makes, or None when its decode is not picklable (a closure: then
        it runs here, as without workers)."""
        try:
            pickle.dumps(decode)
        except (pickle.PicklingError, AttributeError, TypeError):
            return None
        if kwargs.get("json_body") is not None:  # encoded here: orjson, not a pickle of it
            kwargs = {**kwargs, "content": dumps(kwargs["json_body"]), "json_body": None}
        return Call(self.url, self._api_key, self._worker_options, method, path, kwargs, decode)

    async def ok(self, path: str, timeout_s: float) -> bool:
        """True when GET `path` answers 200 within `timeout_s` (no retries)."""
        await trio.lowlevel.checkpoint_if_cancelled()  # as in `call`
        try:
            with trio.fail_after(timeout_s):
                response = await self._pool(path).get(path)
        except (httpx.TransportError, trio.TooSlowError):
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        """Close both connection pools."""
        for shard in self._shards:
            await shard.aclose()
        await self._control.aclose()
