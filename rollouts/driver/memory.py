"""Memory of the run's processes per step: the driver's and the trainer process's RSS as metrics
(`perf/driver_rss_mb`, `perf/trainer_rss_mb`), and a console warning when one grows steadily.

A reward function that keeps what it is given grows the driver by tens of MB a step until the
machine swaps or the kernel kills the run, with nothing in the metrics to say so. The RSS is read
from /proc/<pid>/status (Linux; elsewhere no metric). `steady_growth` decides, as a pure
function of the history: over the last `WINDOW_STEPS` steps, rises on most steps and a total
growth of at least `MIN_GROWTH_MB` and `MIN_GROWTH_RATIO` of where it started.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

WINDOW_STEPS = 10  # steps the growth is judged over
MIN_RISES = 8  # of the WINDOW_STEPS step-to-step changes, at least this many are rises
RISE_MB = 1.0  # a smaller change is noise (the allocator moves a few pages either way)
MIN_GROWTH_MB = 100.0
MIN_GROWTH_RATIO = 0.2
WARM_UP_STEPS = 2  # the first steps grow anyway (allocator, caches, compiled kernels)


def rss_mb(pid: int) -> float | None:
    """The resident set size of process `pid` in MB (None: gone, or no /proc here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0  # kB
    return None


def steady_growth(history_mb: Sequence[float]) -> float | None:
    """MB grown over the last WINDOW_STEPS steps when the growth is steady (see the module
    doc), else None. The first WARM_UP_STEPS values are not judged."""
    judged = list(history_mb[WARM_UP_STEPS:])
    if len(judged) < WINDOW_STEPS + 1:
        return None
    window = judged[-(WINDOW_STEPS + 1) :]
    rises = sum(1 for a, b in itertools.pairwise(window) if b - a >= RISE_MB)
    growth = window[-1] - window[0]
    enough = growth >= max(MIN_GROWTH_MB, MIN_GROWTH_RATIO * window[0])
    return growth if rises >= MIN_RISES and enough else None


@dataclasses.dataclass(kw_only=True, slots=True)
class MemoryWatch:
    """Samples the RSS of named processes once per logged step; warns on steady growth (once
    per WINDOW_STEPS steps and process)."""

    processes: Mapping[str, int]  # "driver" -> its pid, "trainer" -> the trainer process's
    history: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    warned_at: dict[str, int] = dataclasses.field(default_factory=dict)

    def __call__(self, step: int) -> dict[str, float]:
        """`perf/<name>_rss_mb` of each process still there."""
        metrics: dict[str, float] = {}
        for name, pid in self.processes.items():
            mb = rss_mb(pid)
            if mb is None:
                continue
            metrics[f"perf/{name}_rss_mb"] = mb
            history = self.history.setdefault(name, [])
            history.append(mb)
            self._warn_if_growing(name, pid, step, history)
        return metrics

    def _warn_if_growing(self, name: str, pid: int, step: int, history: list[float]) -> None:
        growth = steady_growth(history)
        last = self.warned_at.get(name)
        if growth is None or (last is not None and step - last < WINDOW_STEPS):
            return
        self.warned_at[name] = step
        start = history[-(WINDOW_STEPS + 1)]
        print(
            f"[train] warning: the {name} process (pid {pid}) grew steadily from {start:.0f} MB "
            f"to {history[-1]:.0f} MB over the last {WINDOW_STEPS} steps (step {step}); "
            "something keeps memory from step to step (a reward function or environment "
            f"that stores samples?); perf/{name}_rss_mb in the metrics shows the trend",
            flush=True,
        )
