"""How many torch threads a CPU engine's decode steps use, chosen again while it runs.

An OpenMP team waits at the end of every parallel region for its slowest thread. When another
busy process shares one of the team's cores, the thread there gets a slice of it, and every
region waits for that slice: on the 2-core box a 2-thread engine decoded SmolLM2 at 29-36 tok/s
beside a process spinning on core 0 and a niced benchmark, 112-113 beside the spinner alone,
against 183 tok/s with one thread and 284-342 with two on the quiet box (`docs/benchmarks.md`,
"The built-in engine beside other load"). Nothing in the engine can see the other
process, but it can see its own steps get slower.

So every `probe_every_s` seconds of decoding (or longer: probes take at most 2% of it) the
governor runs `probe_steps` decode steps at the other thread count (one thread when it runs
several; all of them when it runs one) and keeps the count whose steps took less time per row, by
`margin`. The rows of steps this close together are nearly the same, so seconds per row compare
like with like. Beside a busy process the engine falls back to one thread at its next probe, and
returns to all of them when the other process ends. Steps that have become `SLOWER` a row than
the best seen at their count are probed at once (at most every `probe_every_s`), whatever the 2%.
Off by default (`--adapt-threads on`): on the quiet 2-core box an engine with it decoded 3-10%
slower than one without in three paired runs, and beside one busy process it gained 0-9% (it
switched to one thread, 4-8x faster a row, but late in the batch); the next step is to find
where the quiet cost comes from. The thread count does not change the engine's numbers (a
forward is bit-equal at one and two threads, `tests/engine/test_threads.py`), only its speed.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)
PROBE_EVERY_S = 5.0
PROBE_STEPS = 3
MARGIN = 1.15
PROBE_SHARE = 0.02  # at most this share of decoding time in probes (long steps probe less often)
SLOWER = 2.0  # steps this much slower a row than the best seen at this count: probe at once


@dataclasses.dataclass(slots=True)
class ThreadGovernor:
    """Told each decode step's rows and seconds; sets the thread count through `set_threads`."""

    most: int  # the engine's thread count (its --torch-threads, or torch's default)
    set_threads: Callable[[int], None]
    probe_every_s: float = PROBE_EVERY_S
    probe_steps: int = PROBE_STEPS
    margin: float = MARGIN
    probe_share: float = PROBE_SHARE
    current: int = 0
    switches: int = 0
    _since_probe_s: float = 0.0
    _recent: deque[float] = dataclasses.field(default_factory=deque)
    _best: dict[int, float] = dataclasses.field(default_factory=dict)  # seconds a row, by count
    _probe: list[float] | None = None

    def __post_init__(self) -> None:
        assert self.most > 1, f"{self.most=}: one thread has nothing to choose from"
        self.current = self.current or self.most
        self._recent = deque(maxlen=self.probe_steps)

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def other(self) -> int:
        return 1 if self.current == self.most else self.most

    def step_done(self, rows: int, seconds: float) -> None:
        """One decode step of `rows` rows took `seconds` (at the count set before it)."""
        if rows <= 0:
            return
        per_row = seconds / rows
        if self._probe is not None:
            self._probe.append(per_row)
            if len(self._probe) >= self.probe_steps:
                self._decide()
            return
        self._recent.append(per_row)
        self._since_probe_s += seconds
        if len(self._recent) < self.probe_steps or self._since_probe_s < self.probe_every_s:
            return
        now = statistics.median(self._recent)
        best = self._best.setdefault(self.current, now)
        self._best[self.current] = min(best, now)
        slowed = now > SLOWER * best
        if slowed or self._since_probe_s >= self.probe_steps * seconds / self.probe_share:
            self._probe = []
            self.set_threads(self.other())

    def _decide(self) -> None:
        assert self._probe is not None
        here, there = statistics.median(self._recent), statistics.median(self._probe)
        self._best[self.other()] = min(self._best.get(self.other(), there), there)
        if there * self.margin < here:
            log.info(
                "decode steps took %.3f ms a row with %d torch threads, %.3f with %d: now %d",
                1e3 * there,
                self.other(),
                1e3 * here,
                self.current,
                self.other(),
            )
            self.current = self.other()
            self.switches += 1
        self.set_threads(self.current)
        self._probe = None
        self._recent.clear()
        self._since_probe_s = 0.0
