"""EnginePool: several engines behind the one InferenceEngine Protocol.

Each request goes to the least-loaded healthy engine (loads counted by the pool itself: its own
in-flight requests per engine, no extra HTTP). An engine whose call fails with EngineUnavailable
is marked down and the request is retried on another (at most once per engine; once more after
waiting, bounded, for an engine to come back when none is left); a periodic health check
(`run_health_checks`, started by the owner in its nursery) brings it back once /health is
200 and it serves the pool's weights: an engine that comes back with other weights (restarted on
the starting model, or an external server restarted by hand) first reloads the pool's current
weights (`set_weights`) and proves their version, under `weights_lock` so that it never
interleaves with a weight sync. Each engine has its own health-check loop, so one that waits
for the weights lock never delays another's. An engine that stops answering /health for
`stall_timeout_s` (hung: SIGSTOPped, deadlocked, swapping) is marked down at once and its calls
in flight end (`hung.CallWatch`): a generation goes to the other engines (from its prompt, or
the partial response it was resumed from: a hung engine gives back no tokens), a weight sync
given `watched` engines goes on without it, instead of waiting out the request timeout while
the other engines sit idle; when it answers again it is resumed (a pause it took while hung)
and reloaded before it gets a request. Control calls (pause, resume, weights, abort) go to
every engine that is up, concurrently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import trio

from rollouts.inference.http import EngineError, EngineUnavailable
from rollouts.inference.hung import CallWatch, WatchedEngine
from rollouts.inference.protocol import (
    AdapterLoader,
    EngineLoad,
    InferenceEngine,
    Sleeper,
    batches_requests,
)
from rollouts.wire.generation import Completion, GenerateRequest, SamplingParams


def pick_engine(in_flight: Sequence[int], up: Sequence[bool], tried: set[int]) -> int | None:
    """Index of the least-loaded engine that is up and not yet tried (ties: lowest index)."""
    assert len(in_flight) == len(up), f"{len(in_flight)=} != {len(up)=}"
    best: int | None = None
    for i, (load, alive) in enumerate(zip(in_flight, up, strict=True)):
        if alive and i not in tried and (best is None or load < in_flight[best]):
            best = i
    return best


class EnginePool:
    """Routes requests over engines; satisfies InferenceEngine itself."""

    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        *,
        health_interval_s: float = 5.0,
        down_after_failed_checks: int = 3,
        wait_for_up_s: float = 60.0,
        stall_timeout_s: float = 15.0,
    ):
        assert engines, "an EnginePool needs at least one engine"
        assert health_interval_s > 0, f"{health_interval_s=}"
        assert down_after_failed_checks >= 1, f"{down_after_failed_checks=}"
        assert wait_for_up_s >= 0, f"{wait_for_up_s=}"
        assert stall_timeout_s > 0, f"{stall_timeout_s=}"
        self.engines = list(engines)
        self.url = ",".join(e.url for e in self.engines)
        self.health_interval_s = health_interval_s
        # a slow /health answer on a loaded machine is not a dead engine: several in a row are
        self.down_after_failed_checks = down_after_failed_checks
        # with every engine down, a request waits (bounded) for a health check to bring one back
        self.wait_for_up_s = wait_for_up_s
        # an engine silent on /health this long is hung: down, its requests sent elsewhere
        self.stall_timeout_s = stall_timeout_s
        self.last_answer: list[float | None] = [None] * len(self.engines)  # trio clock
        self.watch = CallWatch([e.url for e in self.engines])  # calls in flight, hung engines
        self.failed_checks = [0] * len(self.engines)
        self.up = [True] * len(self.engines)
        self.gone = [False] * len(self.engines)  # exited for good: no restart will bring it back
        self.in_flight = [0] * len(self.engines)
        # the weights every engine must serve (None: not known yet; any version is fine)
        self.version: str | None = None
        self.weights_path: str | None = None
        self.weights_adapter = False  # weights_path is a LoRA adapter (on the base model)
        self.weights_lock = trio.Lock()  # held by a weight sync and by a returning engine's reload
        self.closed = False  # aclose ran: the clients are gone
        self.asleep = False  # `sleep` ran and `wake_up` not yet: checks ask only liveness

    def mark_down(self, index: int) -> None:
        """Stop routing to engine `index` until a health check passes."""
        self.up[index] = False

    def mark_gone(self, url: str) -> None:
        """Engine `url` exited and will not be restarted: down for good, and a request no
        longer waits for it to come back (with every engine gone, `wait_for_up` returns)."""
        index = [e.url for e in self.engines].index(url)
        self.mark_down(index)
        self.gone[index] = True

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """Generate on the least-loaded healthy engine; on EngineUnavailable try the next one.

        When no engine is up, wait up to `wait_for_up_s` for a health check to bring one back.
        """
        return await self._on_an_engine(1, lambda e: e.generate(input_ids, sampling, rid))

    async def _on_an_engine(self, cost: int, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """`call` on the least-loaded engine that is up (counting `cost` requests in flight
        there); an unreachable or hung one is marked down and the next one tried, once each,
        and once more after waiting (bounded) for one to come back when none is left."""
        errors: list[str] = []
        for _ in range(2):
            if not await self.wait_for_up():
                break
            tried: set[int] = set()
            while (index := pick_engine(self.in_flight, self.up, tried)) is not None:
                tried.add(index)
                done, result = await self._call_on(index, cost, call, errors)
                if done:
                    return result
        raise EngineUnavailable(f"no healthy engine could generate: {errors or 'all are down'}")

    async def _call_on(
        self, index: int, cost: int, call: Callable[[Any], Awaitable[Any]], errors: list[str]
    ) -> tuple[bool, Any]:
        """(True, result) of `call` on engine `index`, or (False, None) when the engine is
        unreachable or hung (marked down); the error is added to `errors`."""
        self.in_flight[index] += cost
        try:
            return True, await self.watch.call(index, lambda: call(self.engines[index]))
        except EngineUnavailable as exc:
            self.mark_down(index)
            errors.append(str(exc))
        finally:
            self.in_flight[index] -= cost
        return False, None

    def watched(self, index: int) -> InferenceEngine:
        """Engine `index`, whose calls end (EngineUnavailable) once it is found hung: for
        callers that reach engines one by one (a weight sync)."""
        return WatchedEngine(self.engines[index], index, self.watch)  # type: ignore[return-value]

    @property
    def batch_generate(self) -> bool:
        """True when every engine takes a batch of prompts in one request."""
        return all(batches_requests(e) for e in self.engines)

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """The whole batch on the least-loaded healthy engine (a group's prompts stay on one
        engine, whose prefix cache they share); on EngineUnavailable the next one gets it all."""
        assert self.batch_generate, "generate_many needs engines that batch (SGLang's API)"
        return await self._on_an_engine(len(requests), lambda e: e.generate_many(requests))

    async def wait_for_up(self) -> bool:
        """Wait up to `wait_for_up_s` for an engine to be up (health checks bring them back);
        not at all once every engine is gone for good."""
        with trio.move_on_after(self.wait_for_up_s):
            while not any(self.up) and not all(self.gone):
                await trio.sleep(min(0.2, self.health_interval_s))
        return any(self.up)

    def set_weights(self, path: str, version: str, *, adapter: bool = False) -> None:
        """Record the weights every engine serves (after a sync, or the starting model);
        `adapter`: `path` is a LoRA adapter the engines load on their base model."""
        self.weights_path, self.version = str(path), str(version)
        self.weights_adapter = adapter

    async def _each_up(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> list[Any]:
        """`call` on every engine that is up, concurrently; an unreachable one is marked down."""
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            try:
                results[i] = await self.watch.call(i, lambda: call(self.engines[i]))
            except EngineUnavailable:
                self.mark_down(i)

        async with trio.open_nursery() as nursery:
            for i, alive in enumerate(self.up):
                if alive:
                    nursery.start_soon(one, i)
        if not results:
            raise EngineUnavailable(f"no engine of {self.url} is up")
        return [results[i] for i in sorted(results)]

    async def sleep(self, level: int) -> None:
        """Every up engine releases its memory (`Sleeper`: what runs is aborted first) while a
        colocated trainer trains; health checks ask only liveness until `wake_up`."""
        async with self.weights_lock:
            self.asleep = True
            with contextlib.suppress(EngineUnavailable):  # none up: none to put to sleep
                await self._each_up(lambda e: cast(Sleeper, e).sleep(level))

    async def wake_up(self) -> None:
        """Every up engine takes its memory back (after a level-2 sleep the caller reloads the
        weights before it generates)."""
        async with self.weights_lock:
            down = [i for i, up in enumerate(self.up) if not up and not self.gone[i]]
            with contextlib.suppress(EngineUnavailable):  # none up: the sync waits for one
                await self._each_up(lambda e: cast(Sleeper, e).wake_up())
            for i in down:  # marked down while asleep (a slow check): awake when it is back
                with trio.move_on_after(self.stall_timeout_s), contextlib.suppress(EngineError):
                    await cast(Sleeper, self.engines[i]).wake_up()
            self.asleep = False

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """Reload on every engine that is up; engines brought back later load it too."""
        async with self.weights_lock:
            self.set_weights(path, version)
            await self._each_up(lambda e: e.update_weights_from_disk(path, version))

    async def pause(self, mode: str = "abort") -> None:
        """Pause every engine that is up."""
        await self._each_up(lambda e: e.pause(mode))

    async def resume(self) -> None:
        """Resume every engine that is up."""
        await self._each_up(lambda e: e.resume())

    async def abort_all(self) -> None:
        """Abort everything on every engine that is up."""
        await self._each_up(lambda e: e.abort_all())

    async def abort(self, rid_prefix: str) -> None:
        """Abort the requests whose id starts with `rid_prefix` on every engine that is up."""
        await self._each_up(lambda e: e.abort(rid_prefix))

    async def health(self) -> bool:
        """True when at least one engine is up and answers /health."""
        checks = await self._each_up(lambda e: e.health())
        return any(checks)

    async def weight_version(self) -> str:
        """The version every up engine serves (an EngineError if they disagree)."""
        versions = set(await self._each_up(lambda e: e.weight_version()))
        if len(versions) != 1:
            raise EngineError(f"engines of {self.url} serve different versions: {sorted(versions)}")
        return versions.pop()

    async def load(self) -> EngineLoad:
        """Sum of the up engines' loads."""
        loads = await self._each_up(lambda e: e.load())
        return EngineLoad(
            running=sum(x.running for x in loads), waiting=sum(x.waiting for x in loads)
        )

    async def check_health(self) -> None:
        """One round: an engine is up iff /health is 200 and it serves the pool's weights."""
        async with trio.open_nursery() as nursery:
            for i in range(len(self.engines)):
                nursery.start_soon(self._check_one, i)

    async def _check_one(self, i: int) -> None:
        alive = False
        with trio.move_on_after(self.stall_timeout_s):  # a hung engine does not answer at all
            alive = await self.engines[i].health()
        now = trio.current_time()
        if alive:
            self.last_answer[i] = now
        elif not self.watch.hung[i] and now - (self.last_answer[i] or now) >= self.stall_timeout_s:
            self._stalled(i, now - (self.last_answer[i] or now))
            return
        if alive and self.asleep and not self.up[i]:
            return  # it proves its weights once the pool is awake
        if alive and self.version is not None and not self.asleep:
            async with self.weights_lock:  # a returning engine must prove it; an up one may not say
                if self.closed:  # handed the lock as the pool closed: its clients are gone
                    return
                current = await self._serves_current(i, proof_required=not self.up[i])
            if not current:  # alive with other weights: never routed to
                self.up[i] = False
                return
        if alive and self.watch.hung[i] and not self.asleep:  # back from a hang: undo a pause
            with trio.move_on_after(self.stall_timeout_s), contextlib.suppress(EngineError):
                await self.engines[i].resume()
            self.watch.clear(i)
        self.failed_checks[i] = 0 if alive else self.failed_checks[i] + 1
        if alive:
            if not self.up[i]:
                url = self.engines[i].url
                print(f"[engines] {url} is back on weights {self.version}", flush=True)
            self.up[i] = True
        elif self.failed_checks[i] >= self.down_after_failed_checks:
            self.up[i] = False

    def _stalled(self, i: int, silent_s: float) -> None:
        """Engine `i` is hung: down, and its calls in flight end (see `hung.CallWatch`)."""
        self.mark_down(i)
        calls = self.watch.mark_hung(i)
        print(
            f"[engines] {self.engines[i].url} has not answered /health for {silent_s:.1f}s "
            f"(engines.stall_timeout_s = {self.stall_timeout_s}): marked down; its "
            f"{calls} call(s) in flight end and go to the other engines",
            flush=True,
        )

    async def _serves_current(self, i: int, *, proof_required: bool) -> bool:
        """True when engine `i` serves the pool's version, after reloading its weights if not.

        An engine that cannot say its version (an EngineError) passes only if no proof is
        required (it is up and was synced); one that says another version is reloaded.
        """
        engine = self.engines[i]
        try:
            served = await engine.weight_version()
        except EngineError:
            return not proof_required
        if served == self.version:
            return True
        if self.weights_path is None or self.version is None:
            return False
        try:
            if self.weights_adapter and isinstance(engine, AdapterLoader):
                await engine.load_adapter(self.weights_path, self.version)
            else:
                await engine.update_weights_from_disk(self.weights_path, self.version)
            return await engine.weight_version() == self.version
        except EngineError:
            return False

    async def run_health_checks(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Check each engine every `health_interval_s` until cancelled (start it in the owner's
        nursery); one loop per engine, so a check that waits (for the weights lock, or on a
        hung engine) never delays another engine's."""
        now = trio.current_time()  # silence is counted from here for engines never heard yet
        self.last_answer = [t if t is not None else now for t in self.last_answer]
        async with trio.open_nursery() as nursery:
            for i in range(len(self.engines)):
                nursery.start_soon(self._check_loop, i)
            task_status.started()

    async def _check_loop(self, i: int) -> None:
        while not self.closed:
            await trio.sleep(self.health_interval_s)
            if not self.closed:
                await self._check_one(i)

    async def aclose(self) -> None:
        """Close every engine's client (health checks still running stop checking)."""
        self.closed = True
        for engine in self.engines:
            await engine.aclose()
