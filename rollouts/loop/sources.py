"""Where the RL loop's batches come from.

`BatchSource` makes batch k now (sync mode) or has a producer task make it one batch ahead
(async mode); it remembers the DataBuffer state from before each batch, for exact resume, and
tells the manager the version the batch will be trained at (`state.train_version`), so
partial work that would be too stale by then is dropped before any generation is spent on it.
A batch that fails (the engines are gone) gives its prompts back: the buffer returns to its
state from before the batch. The producer makes no batch past `limit` (the loop raises it for
each batch that trained nothing). The batch made ahead can be taken early and kept in a
checkpoint (`held_state`), so a resumed async run trains the very batch the uninterrupted run
would have (made on the same, older, weights) instead of a new one made on the checkpoint's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from rollouts.data.buffer import DataBuffer
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import RolloutBatch, sample_from_dict, sample_to_dict

Made = tuple[RolloutBatch, float]  # a batch and the seconds spent generating it


def batch_to_dict(batch: RolloutBatch, gen_s: float) -> dict[str, Any]:
    """A JSON-safe form of a made batch (its samples, statistics and generation time)."""
    return {
        "groups": [[sample_to_dict(s) for s in group] for group in batch.groups],
        "metadata": dict(batch.metadata),
        "failed": [sample_to_dict(s) for s in batch.failed],
        "gen_s": gen_s,
    }


def batch_from_dict(data: dict[str, Any]) -> Made:
    """Inverse of `batch_to_dict`."""
    groups = tuple(tuple(sample_from_dict(s) for s in group) for group in data["groups"])
    failed = tuple(sample_from_dict(s) for s in data.get("failed", ()))
    batch = RolloutBatch(groups=groups, metadata=dict(data["metadata"]), failed=failed)
    return batch, float(data["gen_s"])


class Batches(Protocol):
    """What the RL loop takes its batches from: `BatchSource` (the engines) or a replay's
    stored batches (`loop/halves.py` `ReplaySource`). `phase` names the step's time of taking
    one (`time/<phase>_s`)."""

    phase: str

    async def next(self, number: int) -> Made: ...

    def restore_held(self, state: dict[str, Any] | None) -> int | None: ...

    def start_producer(self, nursery: trio.Nursery, first: int, last: int) -> None: ...

    def raise_limit(self, last: int) -> None: ...

    def forget_before(self, number: int) -> None: ...

    async def take_ahead(self, number: int) -> None: ...

    def held_state(self) -> dict[str, Any] | None: ...

    def state_for_resume(self, next_number: int) -> dict[str, Any]: ...


class BatchSource:
    """Where the next rollout batch comes from: made now (sync) or by a producer task (async).

    Remembers the DataBuffer state from just before each batch began, so a checkpoint after step
    k stores the state from which the next batch is generated, even when the producer is ahead.
    """

    def __init__(
        self,
        manager: AsyncRolloutManager,
        reward_fn: Any,
        buffer: DataBuffer,
        staleness: Callable[[int], tuple[str, int]],
        engines_ready: Callable[[], Awaitable[None]] | None = None,  # no delivery in flight
    ) -> None:
        self.phase = "generate"
        self.manager = manager
        self.reward_fn = reward_fn
        self.buffer = buffer
        # batch number -> (the policy version it will be trained at, the staleness bound)
        self.staleness = staleness
        self.engines_ready = engines_ready  # awaited before a batch starts (a weight delivery)
        self.states: dict[int, dict[str, Any]] = {}
        self.held: dict[int, Made] = {}  # made, taken from the producer, not yet trained
        self.limit = 0  # the producer makes batches up to this number
        self._limit_raised = trio.Event()
        self._recv: trio.MemoryReceiveChannel[Made | Exception] | None = None

    async def _make(self, number: int) -> Made:
        if self.engines_ready is not None:
            await self.engines_ready()
        self.states[number] = self.buffer.state_dict()
        started = time.monotonic()
        version, bound = self.staleness(number)
        try:
            batch = await self.manager.generate_batch(
                self.reward_fn, policy_version=version, max_staleness=bound, batch_number=number
            )
        except Exception as error:  # the batch is lost: its prompts go back to the buffer
            self.buffer.load_state_dict(self.states[number])
            note = f"[rollout] batch {number} was lost ({type(error).__name__}); its prompts "
            print(f"{note}went back to the buffer", flush=True)
            error.add_note(f"{note}went back to the buffer")
            raise
        return batch, time.monotonic() - started

    def raise_limit(self, last: int) -> None:
        """Let the producer make batches up to number `last`."""
        if last > self.limit:
            self.limit = last
            self._limit_raised.set()
            self._limit_raised = trio.Event()

    def start_producer(self, nursery: trio.Nursery, first: int, last: int) -> None:
        """Make batches `first..limit` one ahead of the loop (`limit` = `last` until raised).
        A batch that fails (engines down, a reward function raising) is handed to the loop as
        its error, so it is raised between steps, never inside one (the loop can then
        checkpoint the last trained step)."""
        send, self._recv = trio.open_memory_channel[Made | Exception](0)
        self.raise_limit(last)

        async def produce() -> None:
            number = first
            async with send:
                while True:
                    while number > self.limit:
                        await self._limit_raised.wait()
                    try:
                        made: Made | Exception = await self._make(number)
                    except Exception as error:
                        made = error
                    await send.send(made)
                    if isinstance(made, Exception):
                        return
                    number += 1

        nursery.start_soon(produce)

    async def next(self, number: int) -> Made:
        """Batch `number` and the seconds spent generating it (its error, raised)."""
        if number in self.held:
            return self.held.pop(number)
        if self._recv is None:
            return await self._make(number)
        made = await self._recv.receive()
        if isinstance(made, Exception):
            raise made
        return made

    async def take_ahead(self, number: int) -> None:
        """Wait for batch `number` from the producer and hold it (for `held_state`)."""
        assert self._recv is not None, "only a producer makes batches ahead"
        if number not in self.held:
            self.held[number] = await self.next(number)

    def held_state(self) -> dict[str, Any] | None:
        """The batch taken ahead, JSON-safe (None when there is none): a checkpoint keeps it."""
        if not self.held:
            return None
        (number, (batch, gen_s)), *rest = self.held.items()
        assert not rest, f"several batches held: {sorted(self.held)}"
        return {"number": number} | batch_to_dict(batch, gen_s)

    def restore_held(self, state: dict[str, Any] | None) -> int | None:
        """Hold a checkpoint's batch again (a resumed run trains it first); its number."""
        if not state:
            return None
        self.held[int(state["number"])] = batch_from_dict(state)
        return int(state["number"])

    def state_for_resume(self, next_number: int) -> dict[str, Any]:
        """The buffer state from which batch `next_number` is (or will be) generated."""
        return self.states.get(next_number) or self.buffer.state_dict()

    def forget_before(self, number: int) -> None:
        """Drop the buffer states of batches before `number` (no checkpoint needs them now)."""
        for old in [n for n in self.states if n < number]:
            del self.states[old]
