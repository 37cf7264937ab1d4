"""A weight sync as the pool sees it: what a delivery is given and gives back, and its options.

`EnginePool.sync(delivery)` does what every sync does (wait, bounded, for an engine; take the
weights lock; mark the engines that failed down and the others up; record the weights the
engines now serve). A `Delivery` only delivers: the disk and adapter deliveries
(`weights/disk.py`) have each engine reload files, the distributed one
(`weights/distributed_pool.py`) broadcasts over a process group. Each says per engine whether
it took the weights, proven by content when it has a probe. An engine that comes back later
loads the recorded weights before it is routed to (`serves`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from rollouts.inference.http import EngineError
from rollouts.inference.protocol import AdapterLoader, InferenceEngine
from rollouts.wire.generation import PAUSE_MODES, PauseMode


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncOptions:
    """How each engine is synced, built once from the config (`weights/publisher.py`)."""

    attempts: int = 3  # tries per engine before it has failed (a disk or adapter reload)
    timeout_s: float = 300.0  # one try: pause, load, resume, verify, content check
    pause: PauseMode = "abort"  # what the pause does to the requests in flight
    retry_delay_s: float = 0.5  # times the attempt number, between tries

    def __post_init__(self) -> None:
        assert self.attempts >= 1, f"{self.attempts=}"
        assert self.timeout_s > 0, f"{self.timeout_s=}"
        assert self.pause in PAUSE_MODES, f"{self.pause=} not in {PAUSE_MODES}"
        assert self.retry_delay_s >= 0, f"{self.retry_delay_s=}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Weights:
    """The weights every engine of a pool must serve: a version, and where a returning engine
    reloads them from (None: nowhere, as after a distributed sync; it waits for the next)."""

    version: str
    path: str | None = None
    adapter: bool = False  # `path` is a LoRA adapter the engines load on their base model

    def __post_init__(self) -> None:
        assert self.version, f"{self.version=}"
        assert not (self.adapter and self.path is None), "an adapter needs its path"


async def serves(engine: InferenceEngine, weights: Weights, *, proof_required: bool) -> bool:
    """True when `engine` serves `weights.version`, after reloading them if it does not (an
    engine coming back: restarted on the starting model, or an external server restarted).

    An engine that cannot say its version (an EngineError) passes only if no proof is
    required (it is up and was synced); one that says another version is reloaded.
    """
    try:
        served = await engine.weight_version()
    except EngineError:
        return not proof_required
    if served == weights.version:
        return True
    if weights.path is None:
        return False
    try:
        if weights.adapter and isinstance(engine, AdapterLoader):
            await engine.load_adapter(weights.path, weights.version)
        else:
            await engine.update_weights_from_disk(weights.path, weights.version)
        return await engine.weight_version() == weights.version
    except EngineError:
        return False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineSyncResult:
    """How one engine's sync went: phase times of the last attempt, and its error if it failed."""

    url: str
    ok: bool
    attempts: int
    error: str | None = None
    pause_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    verify_s: float = 0.0
    check_s: float = 0.0
    content_gap: float = 0.0  # |engine - trainer| logprob on the probe (its statistic; the check)
    total_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """All engines' results for one weight version."""

    version: str
    path: str
    results: tuple[EngineSyncResult, ...]
    total_s: float
    # engines that do not serve this version after the sync: failed, or down and not synced
    engines_down: int = 0
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # method-specific numbers

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> tuple[EngineSyncResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for the metrics log: wall time, slowest engine per phase, failures."""
        out = {"total_s": self.total_s, "failed_engines": float(len(self.failed))}
        out["engines_down"] = float(self.engines_down)
        for phase in ("pause_s", "load_s", "resume_s", "verify_s", "check_s", "content_gap"):
            out[f"{phase}_max"] = max((getattr(r, phase) for r in self.results), default=0.0)
        out["attempts"] = float(sum(r.attempts for r in self.results))
        return out | self.stats


class WeightSyncError(RuntimeError):
    """Some engines did not end up serving the new version (the report says which and why)."""

    def __init__(self, report: SyncReport, step: int | None = None) -> None:
        self.report, self.step = report, step
        lines = [f"  {r.url}: {r.error} (after {r.attempts} attempt(s))" for r in report.failed]
        at = f" at step {step}" if step is not None else ""
        super().__init__(
            f"weight sync to version {report.version!r}{at} ({report.path}) failed on "
            f"{len(report.failed)} of "
            f"{len(report.results)} engine(s):\n" + "\n".join(lines)
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Delivered:
    """What a delivery did: its report, and the engines that did not take the weights (by
    their position in the engines it was given, with why); every other one serves them."""

    report: SyncReport
    failed: Mapping[int, str]


class Delivery(Protocol):
    """The trainer's weights on their way to a pool's engines (see the module docstring)."""

    @property
    def weights(self) -> Weights:
        """What the engines serve once they took it."""
        ...

    @property
    def collective(self) -> bool:
        """A process group: down engines that answer /health join too, and the group's own
        timeout bounds the calls (the pool's hung-engine watch does not)."""
        ...

    async def deliver(self, engines: Sequence[InferenceEngine]) -> Delivered:
        """Make `engines` serve `weights`; an engine failure is reported in `Delivered.failed`,
        never raised (a delivery may raise when none could take them: nothing is recorded)."""
        ...
