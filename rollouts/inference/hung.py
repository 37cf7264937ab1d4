"""Calls to engines that the pool's health check can cancel when it finds an engine hung.

A hung engine (SIGSTOPped, deadlocked, swapping) still accepts connections, so a call to it
neither fails nor answers: it waits out its whole timeout. `CallWatch` keeps a cancel scope
for every call in flight per engine; when the health check finds an engine silent for
`stall_timeout_s` it marks the engine hung, and each of its calls (a generation, or a weight
sync's pause or reload) ends at once with EngineUnavailable, so the pool sends a generation to
another engine and a weight sync goes on without it. Until the engine answers again, a new
call to it fails at once. `WatchedEngine` is an engine whose every async call goes through the
watch (what the weight sync is given).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from rollouts.inference.http import EngineUnavailable

T = TypeVar("T")


class CallWatch:
    """Per engine: the calls in flight (cancel scopes) and whether it is marked hung."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.hung = [False] * len(self.urls)
        self._scopes: list[set[trio.CancelScope]] = [set() for _ in self.urls]

    async def call(self, index: int, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()`, a call to engine `index`; EngineUnavailable when the engine is (or is found)
        hung meanwhile."""
        if self.hung[index]:
            raise EngineUnavailable(f"{self.urls[index]}: hung (no /health answer): not called")
        scope = trio.CancelScope()
        self._scopes[index].add(scope)
        try:
            with scope:
                return await fn()
        finally:
            self._scopes[index].discard(scope)
        raise EngineUnavailable(f"{self.urls[index]}: hung (no /health answer): call cancelled")

    def mark_hung(self, index: int) -> int:
        """Engine `index` is hung: cancel its calls in flight (how many); new ones fail."""
        self.hung[index] = True
        scopes = list(self._scopes[index])
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    def clear(self, index: int) -> None:
        """Engine `index` answers again."""
        self.hung[index] = False


class WatchedEngine:
    """Engine `index` of `engines` with every async method called through `watch`."""

    def __init__(self, engine: Any, index: int, watch: CallWatch) -> None:
        assert watch.urls[index] == engine.url, f"{watch.urls[index]=} != {engine.url=}"
        self._engine, self._index, self._watch = engine, index, watch
        self.url = engine.url

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def watched(*args: Any, **kwargs: Any) -> Any:
            return await self._watch.call(self._index, lambda: attr(*args, **kwargs))

        return watched
