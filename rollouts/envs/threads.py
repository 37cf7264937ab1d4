"""User code that may block (tools, `env.step`/`env.reset`, sync generate functions) run off the
trio thread, in worker threads, each call under its own timeout.

A call that overruns its timeout fails with `CallTimeout` ("tool calculator timed out after
5 s"); its thread cannot be killed, so it is abandoned and keeps a slot of the runner's
`CapacityLimiter` until it really returns. The limiter bounds abandoned threads (once every slot
is held by one, further calls time out waiting for a slot), and the runner counts them. Calls
made from a runner's own threads (a tool inside a sync `env.step`) take slots of a second
limiter, so steps holding every outer slot never starve the tools they wait for.

Async user functions are awaited (under the same timeout), and an awaitable a sync function
returns is awaited too, so an `async def` tool never reaches the model as '<coroutine ...>'.
Sync code already on a worker thread (a tool called inside a sync `env.step`) reaches the
runner that started its thread with `call_from_thread`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import trio

from rollouts.plugins import is_async_callable

DEFAULT_MAX_THREADS = 32


class CallTimeout(RuntimeError):
    """A user call (tool, environment step, generate function) overran its timeout."""


_RUNNER: contextvars.ContextVar[ThreadRunner | None] = contextvars.ContextVar(
    "rollouts_thread_runner", default=None
)


class ThreadRunner:
    """Runs user calls in bounded worker threads under per-call timeouts, counting overruns."""

    def __init__(self, max_threads: int = DEFAULT_MAX_THREADS) -> None:
        assert max_threads >= 1, f"{max_threads=} must be >= 1"
        self.limiter = trio.CapacityLimiter(max_threads)
        self.nested_limiter = trio.CapacityLimiter(max_threads)  # calls from our own threads
        self.timed_out = 0  # calls that overran their timeout
        self.abandoned_alive = 0  # their threads that have not returned yet
        self._lock = threading.Lock()

    async def call(
        self, what: str, timeout_s: float, fn: Callable[..., Any], *args: Any, nested: bool = False
    ) -> Any:
        """`fn(*args)` (awaited if async, in a worker thread if sync) within `timeout_s`;
        `nested`: made from one of this runner's threads."""
        assert timeout_s > 0, f"{what}: {timeout_s=} must be > 0"
        try:
            with trio.fail_after(timeout_s):
                if is_async_callable(fn):
                    return await fn(*args)
                out = await self._in_thread(fn, args, nested)
                return await out if inspect.isawaitable(out) else out
        except trio.TooSlowError:
            self.timed_out += 1
            raise CallTimeout(
                f"{what} timed out after {timeout_s:g} s "
                f"({self.abandoned_alive} abandoned thread(s) still running)"
            ) from None

    async def _in_thread(self, fn: Callable[..., Any], args: tuple[Any, ...], nested: bool) -> Any:
        state = {"done": False, "abandoned": False}

        def body() -> Any:
            _RUNNER.set(self)  # the thread runs in a copied context: nothing leaks out
            try:
                return (fn(*args),)  # boxed: trio refuses a bare coroutine from a thread
            finally:
                with self._lock:
                    state["done"] = True
                    if state["abandoned"]:
                        self.abandoned_alive -= 1

        try:
            limiter = self.nested_limiter if nested else self.limiter
            (out,) = await trio.to_thread.run_sync(body, abandon_on_cancel=True, limiter=limiter)
            return out
        except trio.Cancelled:
            with self._lock:
                if not state["done"]:
                    state["abandoned"] = True
                    self.abandoned_alive += 1
            raise


def call_from_thread(what: str, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """From sync code: run `fn(*args)` through the runner of this worker thread (timeout,
    awaiting async functions); outside any runner, call it directly (awaiting it with
    `trio.run` when it is async)."""
    runner = _RUNNER.get()
    if runner is not None:
        call = functools.partial(runner.call, what, timeout_s, fn, *args, nested=True)
        return trio.from_thread.run(call)
    out = fn(*args)
    if inspect.iscoroutine(out):
        return trio.run(_awaited, out)
    return out


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
