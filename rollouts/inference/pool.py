"""EnginePool: several engines behind the one InferenceEngine Protocol.

Each request goes to the least-loaded healthy engine (loads counted by the pool itself: its own
in-flight requests per engine, no extra HTTP). An engine whose call fails with EngineUnavailable is
marked down and the request is retried on another (at most once per engine; once more after waiting,
bounded, for an engine to come back when none is left); a periodic health check
(`run_health_checks`, started by the owner in its nursery) brings it back once /health is 200 and it
serves the pool's weights: an engine that comes back with other weights (restarted on the starting
model, or an external server restarted by hand) first reloads the pool's current weights
(`set_weights`) and proves their version, under `weights_lock` so that it never interleaves with a
weight sync. Each engine has its own health-check loop, so one that waits for the weights lock never
delays another's. An engine that stops answering /health for `stall_timeout_s` (hung: SIGSTOPped,
deadlocked, swapping) is marked down at once and its calls in flight end (`hung.CallWatch`): a
generation goes to the other engines (from its prompt, or the partial response it was resumed from:
a hung engine gives back no tokens), a weight sync given `watched` engines goes on without it,
instead of waiting out the request timeout while the other engines sit idle; when it answers again
it is resumed (a pause it took while hung) and reloaded before it gets a request. Control calls
(pause, resume, weights, abort) go to every engine that is up, concurrently. A weight sync is the
pool's too (`sync`: wait, lock, deliver, mark down, record; a `Delivery` only delivers). Each
engine's state is one `EngineState` record, written only here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import trio

from rollouts import tracing
from rollouts.inference.http import EngineError, EngineUnavailable
from rollouts.inference.hung import CallWatch, WatchedEngine
from rollouts.inference.pool_state import EngineState, PoolOptions, pick_engine
from rollouts.inference.protocol import EngineLoad, InferenceEngine, Sleeper, batches_requests
from rollouts.inference.sync import Delivery, SyncReport, Weights, WeightSyncError, serves
from rollouts.wire.generation import Completion, GenerateRequest, PauseMode, SamplingParams


class EnginePool:
    """Routes requests over engines; satisfies InferenceEngine itself; owns the weight sync."""

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
        self.options = PoolOptions(
            health_interval_s=health_interval_s,
            down_after_failed_checks=down_after_failed_checks,
            wait_for_up_s=wait_for_up_s,
            stall_timeout_s=stall_timeout_s,
        )
        self._states = tuple(EngineState(engine=e) for e in engines)
        self.url = ",".join(e.url for e in engines)
        self.watch = CallWatch([e.url for e in engines])  # calls in flight, hung engines
        # the weights every engine must serve (None: not known yet; any version is fine)
        self.weights: Weights | None = None
        self.weights_lock = trio.Lock()  # held by a weight sync and by a returning engine's reload
        self.closed = False  # aclose ran: the clients are gone
        self.asleep = False  # `sleep` ran and `wake_up` not yet: checks ask only liveness

    @property
    def engines(self) -> tuple[InferenceEngine, ...]:
        """Every engine's client, in the pool's order."""
        return tuple(s.engine for s in self._states)

    @property
    def states(self) -> tuple[EngineState, ...]:
        """Every engine's record, for reading (tests inject faults through it)."""
        return self._states

    @property
    def up(self) -> list[bool]:
        """Which engines are up now (a copy)."""
        return [s.up for s in self._states]

    def live_engines(self) -> list[InferenceEngine]:
        """The clients of the engines that are up now."""
        return [s.engine for s in self._states if s.up]

    def mark_down(self, index: int) -> None:
        """Stop routing to engine `index` until a health check passes."""
        self._states[index].up = False

    def mark_gone(self, url: str) -> None:
        """Engine `url` exited and will not be restarted: down for good, and a request no
        longer waits for it to come back (with every engine gone, `wait_for_up` returns)."""
        index = [s.engine.url for s in self._states].index(url)
        self.mark_down(index)
        self._states[index].gone = True

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """Generate on the least-loaded healthy engine; on EngineUnavailable try the next one;
        with none up, wait up to `wait_for_up_s` for a health check to bring one back."""
        return await self._on_an_engine(1, lambda e: e.generate(input_ids, sampling, rid))

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> tuple[float, ...]:
        """Each of `input_ids[start:]`'s logprob given the tokens before it, on the least-loaded
        healthy engine (a teacher's scoring); moved on and waited for as `generate`."""
        return await self._on_an_engine(1, lambda e: e.prompt_logprobs(input_ids, start))

    async def prompt_top_logprobs(self, input_ids: Sequence[int], top: int, start: int = 1) -> Any:
        """`prompt_logprobs` and the `top` likeliest (id, logprob) at each of those positions."""
        return await self._on_an_engine(1, lambda e: e.prompt_top_logprobs(input_ids, top, start))

    async def _on_an_engine(self, cost: int, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """`call` on the least-loaded engine that is up (counting `cost` requests in flight
        there); an unreachable or hung one is marked down and the next one tried, once each,
        and once more after waiting (bounded) for one to come back when none is left."""
        errors: list[str] = []
        for _ in range(2):
            if not await self.wait_for_up():
                break
            tried: set[int] = set()
            while (index := self._pick(tried)) is not None:
                tried.add(index)
                done, result = await self._call_on(index, cost, call, errors)
                if done:
                    return result
        raise EngineUnavailable(f"no healthy engine could generate: {errors or 'all are down'}")

    def _pick(self, tried: set[int]) -> int | None:
        loads = [s.in_flight for s in self._states]
        return pick_engine(loads, self.up, tried)

    async def _call_on(
        self, index: int, cost: int, call: Callable[[Any], Awaitable[Any]], errors: list[str]
    ) -> tuple[bool, Any]:
        """(True, result) of `call` on engine `index`, or (False, None) when the engine is
        unreachable or hung (marked down); the error is added to `errors`."""
        state = self._states[index]
        state.in_flight += cost
        tracing.engine_load(state.engine.url, state.in_flight)
        try:
            return True, await self.watch.call(index, lambda: call(state.engine))
        except EngineUnavailable as exc:
            self.mark_down(index)
            errors.append(str(exc))
        finally:
            state.in_flight -= cost
            tracing.engine_load(state.engine.url, state.in_flight)
        return False, None

    def watched(self, index: int) -> InferenceEngine:
        """Engine `index`, whose calls end (EngineUnavailable) once it is found hung: for
        callers that reach engines one by one (a weight sync)."""
        engine = self._states[index].engine
        return WatchedEngine(engine, index, self.watch)  # type: ignore[return-value]

    @property
    def batch_generate(self) -> bool:
        """True when every engine takes a batch of prompts in one request."""
        return all(batches_requests(s.engine) for s in self._states)

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """The whole batch on the least-loaded healthy engine (a group's prompts stay on one
        engine, whose prefix cache they share); on EngineUnavailable the next one gets it all."""
        assert self.batch_generate, "generate_many needs engines that batch (SGLang's API)"
        return await self._on_an_engine(len(requests), lambda e: e.generate_many(requests))

    async def wait_for_up(self) -> bool:
        """Wait up to `wait_for_up_s` for an engine to be up (health checks bring them back);
        not at all once every engine is gone for good."""
        if any(s.up for s in self._states):  # the usual case, on every call: no scope, no wait
            return True
        o = self.options
        with trio.move_on_after(o.wait_for_up_s):
            while not any(self.up) and not all(s.gone for s in self._states):
                await trio.sleep(min(0.2, o.health_interval_s))
        return any(self.up)

    def set_weights(self, path: str, version: str, *, adapter: bool = False) -> None:
        """Record the weights every engine serves (the starting model; a sync records its own);
        `adapter`: `path` is a LoRA adapter the engines load on their base model."""
        self.weights = Weights(version=str(version), path=str(path), adapter=adapter)

    async def sync(self, delivery: Delivery) -> SyncReport:
        """Make the engines serve `delivery.weights`: wait (bounded) for an engine to be up,
        then under the weights lock deliver to the engines that are up (a collective delivery:
        and the down ones that answer /health), mark the ones that failed down and the others
        up, and record the weights, so that an engine coming back later loads them first.

        Raises EngineUnavailable when no engine is up within `wait_for_up_s`, what the delivery
        raises (nothing recorded then), and WeightSyncError when no engine took the weights and
        none comes back on them within `wait_for_up_s` (an engine killed mid-sync and restarted:
        the health check makes it load and prove them, as it does for a generation's wait).
        """
        version = delivery.weights.version
        if not await self.wait_for_up():  # outside the lock: health checks bring engines back
            raise EngineUnavailable(
                f"weight sync to version {version!r}: no engine of {self.url} is up after "
                f"{self.options.wait_for_up_s}s; the run stops (resume it with --resume)"
            )
        async with self.weights_lock:
            targets = await self._sync_targets(delivery.collective)
            if not targets:
                raise EngineUnavailable(f"weight sync to version {version!r}: every engine is down")
            given = [
                self._states[i].engine if delivery.collective else self.watched(i) for i in targets
            ]  # a watched engine's calls end when it is found hung: it fails, not the sync
            delivered = await delivery.deliver(given)
            self._took(targets, delivered.failed)
            self.weights = delivery.weights
        taken = len(targets) - len(delivered.failed)
        if taken == 0 and not await self.wait_for_up():
            raise WeightSyncError(delivered.report)
        return dataclasses.replace(delivered.report, engines_down=len(self._states) - taken)

    async def _sync_targets(self, collective: bool) -> list[int]:
        """The engines a sync goes to: those up, and for a collective one also the down ones
        that answer /health again (they rejoin the group)."""
        return [
            i
            for i, s in enumerate(self._states)
            if s.up or (collective and await s.engine.health())
        ]

    def _took(self, targets: Sequence[int], failed: Mapping[int, str]) -> None:
        """After a delivery to `targets`: the ones that failed (by position) down, the rest up."""
        assert all(0 <= j < len(targets) for j in failed), f"{sorted(failed)=} {len(targets)=}"
        for j, i in enumerate(targets):
            self._states[i].up = j not in failed
            if j in failed:
                url = self._states[i].engine.url
                print(f"[engines] {url} marked down: {failed[j]}", flush=True)

    async def _each_up(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> list[Any]:
        """`call` on every engine that is up, concurrently; an unreachable one is marked down."""
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            try:
                results[i] = await self.watch.call(i, lambda: call(self._states[i].engine))
            except EngineUnavailable:
                self.mark_down(i)

        async with trio.open_nursery() as nursery:
            for i, s in enumerate(self._states):
                if s.up:
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
                await self._each_up(
                    lambda e: tracing.on_engine(e.url, "sleep", cast(Sleeper, e).sleep(level))
                )

    async def wake_up(self) -> None:
        """Every up engine takes its memory back (after a level-2 sleep the caller reloads the
        weights before it generates)."""
        async with self.weights_lock:
            down = [s for s in self._states if not s.up and not s.gone]
            with contextlib.suppress(EngineUnavailable):  # none up: the sync waits for one
                await self._each_up(
                    lambda e: tracing.on_engine(e.url, "wake up", cast(Sleeper, e).wake_up())
                )
            for s in down:  # marked down while asleep (a slow check): awake when it is back
                with trio.move_on_after(self.options.stall_timeout_s):
                    with contextlib.suppress(EngineError):
                        await cast(Sleeper, s.engine).wake_up()
            self.asleep = False

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """Reload on every engine that is up; engines brought back later load it too."""
        async with self.weights_lock:
            self.set_weights(path, version)
            await self._each_up(lambda e: e.update_weights_from_disk(path, version))

    async def pause(self, mode: PauseMode = "abort") -> None:
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
            for i in range(len(self._states)):
                nursery.start_soon(self._check_one, i)

    async def _check_one(self, i: int) -> None:
        s, stall_s = self._states[i], self.options.stall_timeout_s
        alive = False
        with trio.move_on_after(stall_s):  # a hung engine does not answer at all
            alive = await s.engine.health()
        now = trio.current_time()
        if alive:
            s.last_answer = now
        elif not self.watch.hung[i] and now - (s.last_answer or now) >= stall_s:
            self._stalled(i, now - (s.last_answer or now))
            return
        if alive and self.asleep and not s.up:
            return  # it proves its weights once the pool is awake
        if alive and self.weights is not None and not self.asleep:
            async with self.weights_lock:  # a returning engine must prove it; an up one may not say
                if self.closed:  # handed the lock as the pool closed: its clients are gone
                    return
                current = await serves(s.engine, self.weights, proof_required=not s.up)
            if not current:  # alive with other weights: never routed to
                s.up = False
                return
        if alive and self.watch.hung[i] and not self.asleep:  # back from a hang: undo a pause
            with trio.move_on_after(stall_s), contextlib.suppress(EngineError):
                await s.engine.resume()
            self.watch.clear(i)
        self._checked(s, alive)

    def _checked(self, s: EngineState, alive: bool) -> None:
        """The end of a check of `s`: up when alive, down after enough failed checks."""
        s.failed_checks = 0 if alive else s.failed_checks + 1
        if alive:
            if not s.up:
                version = self.weights.version if self.weights is not None else None
                print(f"[engines] {s.engine.url} is back on weights {version}", flush=True)
            s.up = True
        elif s.failed_checks >= self.options.down_after_failed_checks:
            s.up = False

    def _stalled(self, i: int, silent_s: float) -> None:
        """Engine `i` is hung: down, and its calls in flight end (see `hung.CallWatch`)."""
        self.mark_down(i)
        calls = self.watch.mark_hung(i)
        print(
            f"[engines] {self._states[i].engine.url} has not answered /health for {silent_s:.1f}s "
            f"(engines.stall_timeout_s = {self.options.stall_timeout_s}): marked down; its "
            f"{calls} call(s) in flight end and go to the other engines",
            flush=True,
        )

    async def run_health_checks(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Check each engine every `health_interval_s` until cancelled (start it in the owner's
        nursery); one loop per engine, so a check that waits (for the weights lock, or on a
        hung engine) never delays another engine's."""
        now = trio.current_time()  # silence is counted from here for engines never heard yet
        for s in self._states:
            s.last_answer = s.last_answer if s.last_answer is not None else now
        async with trio.open_nursery() as nursery:
            for i in range(len(self._states)):
                nursery.start_soon(self._check_loop, i)
            task_status.started()

    async def _check_loop(self, i: int) -> None:
        while not self.closed:
            await trio.sleep(self.options.health_interval_s)
            if not self.closed:
                await self._check_one(i)

    async def aclose(self) -> None:
        """Close every engine's client (health checks still running stop checking)."""
        self.closed = True
        for s in self._states:
            await s.engine.aclose()
