"""What an EnginePool knows of its engines: one record per engine, the pool's options, and the
routing decision (pure: which engine gets the next request)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollouts.inference.protocol import InferenceEngine


def pick_engine(in_flight: Sequence[int], up: Sequence[bool], tried: set[int]) -> int | None:
    """Index of the least-loaded engine that is up and not yet tried (ties: lowest index)."""
    assert len(in_flight) == len(up), f"{len(in_flight)=} != {len(up)=}"
    best: int | None = None
    for i, (load, alive) in enumerate(zip(in_flight, up, strict=True)):
        if alive and i not in tried and (best is None or load < in_flight[best]):
            best = i
    return best


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolOptions:
    """How a pool watches its engines and waits for them (the `[engines]` config)."""

    health_interval_s: float = 5.0
    # a slow /health answer on a loaded machine is not a dead engine: several in a row are
    down_after_failed_checks: int = 3
    # with every engine down, a request (or a sync) waits, bounded, for a check to bring one back
    wait_for_up_s: float = 60.0
    # an engine silent on /health this long is hung: down, its requests sent elsewhere
    stall_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        assert self.health_interval_s > 0, f"{self.health_interval_s=}"
        assert self.down_after_failed_checks >= 1, f"{self.down_after_failed_checks=}"
        assert self.wait_for_up_s >= 0, f"{self.wait_for_up_s=}"
        assert self.stall_timeout_s > 0, f"{self.stall_timeout_s=}"


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineState:
    """One engine of a pool as the pool sees it. The pool alone writes it."""

    engine: InferenceEngine  # its client (and so its URL)
    up: bool = True  # routed to; a sync reaches it
    gone: bool = False  # exited for good: no restart will bring it back
    in_flight: int = 0  # requests the pool sent it that have not answered: its load
    failed_checks: int = 0  # /health checks failed in a row
    last_answer: float | None = None  # trio clock of its last /health answer
