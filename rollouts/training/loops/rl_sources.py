"""Where the RL loop's batches come from, and the weight delivery that overlaps a step.

`BatchSource` makes batch k now (sync mode) or has a producer task make it one batch ahead
(async mode); it remembers the DataBuffer state from before each batch, for exact resume, and
tells the manager the version the batch will be trained at (`train_version`), so partial work
that would be too stale by then is dropped before any generation is spent on it.
`EngineSync` runs one weight delivery (engines pause, reload, resume, verify) in the background
while the next step trains, and hands its figures or its error back to the loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from rollouts.training.loops.rl_batch import prefixed
from rollouts.types import RolloutBatch

Delivery = Callable[[], Awaitable[dict[str, float]]]  # engines load published weights


def train_version(state: dict[str, Any], number: int) -> int:
    """The policy version batch `number` will be trained at: the version now plus one for each
    earlier step still training (async: the producer makes batch k while step k-1 trains). The
    manager drops partial work staler than the bound at THAT version, so a surplus or aborted
    group kept from the batch before is not resumed (or served) only to be dropped as stale by
    the trainer, leaving the step short of groups."""
    return int(state["version"]) + max(0, number - 1 - int(state["trained_through"]))


class EngineSync:
    """The weight delivery that runs while the next step trains (async mode, disk sync).

    At most one is in flight. The producer waits for it before it starts a batch, so a batch
    is generated with weights at least as new as without overlap (the staleness bound holds);
    the loop collects its result (`finish`) before the next sync, an evaluation or the end,
    and a failed delivery raises there, in the loop (which first checkpoints the trained step).
    """

    def __init__(self) -> None:
        self._done = trio.Event()
        self._done.set()
        self._result: dict[str, float] | Exception | None = None

    def start(self, nursery: trio.Nursery, deliver: Delivery) -> None:
        assert self._done.is_set() and self._result is None, "a delivery is still pending"
        done = self._done = trio.Event()

        async def run() -> None:
            try:
                self._result = await deliver()
            except Exception as error:  # re-raised by `finish`, in the loop
                self._result = error
            finally:
                done.set()

        nursery.start_soon(run)

    async def wait(self) -> None:
        """Until no delivery is in flight (the engines serve the last published version, or
        the delivery failed and `finish` will say so)."""
        await self._done.wait()

    async def finish(self) -> dict[str, float]:
        """The last delivery's `sync/*` metrics ({} when there was none); its error, raised."""
        await self._done.wait()
        result, self._result = self._result, None
        if isinstance(result, Exception):
            raise result
        return prefixed(result, "sync") if result else {}


class BatchSource:
    """Where the next rollout batch comes from: made now (sync) or by a producer task (async).

    Remembers the DataBuffer state from just before each batch began, so a checkpoint after step
    k stores the state from which batch k+1 is generated, even when the producer is ahead.
    """

    def __init__(
        self,
        manager: Any,
        reward_fn: Any,
        buffer: Any,
        staleness: Callable[[int], tuple[str, int]],
        engines_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.manager = manager
        self.reward_fn = reward_fn
        self.buffer = buffer
        # batch number -> (the policy version it will be trained at, the staleness bound)
        self.staleness = staleness
        self.engines_ready = engines_ready  # awaited before a batch starts (a weight delivery)
        self.states: dict[int, dict[str, Any]] = {}
        self._recv: trio.MemoryReceiveChannel[tuple[RolloutBatch, float] | Exception] | None = None

    async def _make(self, number: int) -> tuple[RolloutBatch, float]:
        if self.engines_ready is not None:
            await self.engines_ready()
        self.states[number] = self.buffer.state_dict()
        started = time.monotonic()
        version, bound = self.staleness(number)
        batch = await self.manager.generate_batch(
            self.reward_fn, policy_version=version, max_staleness=bound, batch_number=number
        )
        return batch, time.monotonic() - started

    def start_producer(self, nursery: trio.Nursery, first: int, last: int) -> None:
        """Make batches `first..last` one ahead of the loop. A batch that fails (engines down, a
        reward function raising) is handed to the loop as its error, so it is raised between
        steps, never inside one (the loop can then checkpoint the last trained step)."""
        send, self._recv = trio.open_memory_channel[tuple[RolloutBatch, float] | Exception](0)

        async def produce() -> None:
            async with send:
                for number in range(first, last + 1):
                    try:
                        made: tuple[RolloutBatch, float] | Exception = await self._make(number)
                    except Exception as error:
                        made = error
                    await send.send(made)
                    if isinstance(made, Exception):
                        return

        nursery.start_soon(produce)

    async def next(self, number: int) -> tuple[RolloutBatch, float]:
        """Batch `number` and the seconds spent generating it (its error, raised)."""
        if self._recv is None:
            return await self._make(number)
        made = await self._recv.receive()
        if isinstance(made, Exception):
            raise made
        return made

    def state_for_resume(self, next_number: int) -> dict[str, Any]:
        """The buffer state from which batch `next_number` is (or will be) generated."""
        state = self.states.get(next_number) or self.buffer.state_dict()
        for old in [n for n in self.states if n < next_number]:
            del self.states[old]
        return state
