"""Checks of a run's `trace.json` (`rollouts/tracing.py`): the trace event format's fields, spans
that nest within each lane, and each step's phase spans against its logged phase times. Pure
functions over the loaded events; `scripts/bench_trace.py` and the tests use them.

The format's rules checked (the Trace Event Format document, and what Perfetto's JSON importer
reads): every event has `ph`, `pid`, `tid` and a `name`; "X" has numeric `ts` and `dur >= 0`; "C"
has numeric `ts` and numeric `args` values; "b"/"e" have `cat`, `id` and `ts`, and every "e"
closes a "b" of the same (cat, id, name); "M" names a process or a thread in `args.name`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

PHASES = (
    "generate",
    "load_batch",  # a replay's: the stored batch read
    "sleep",
    "values",
    "logprobs",
    "train",
    "wake",
    "save_batch",
    "sync",
    "eval",
    "checkpoint",
)
_NUMBER = (int, float)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and math.isfinite(value)


def _event_problems(i: int, e: Mapping[str, Any]) -> list[str]:
    where = f"event {i} ({e.get('ph')!r} {e.get('name')!r})"
    p = [f"{where}: no {k!r}" for k in ("ph", "pid", "tid", "name") if k not in e]
    ph = e.get("ph")
    if ph in ("X", "C", "b", "e") and not _is_number(e.get("ts")):
        p.append(f"{where}: ts = {e.get('ts')!r} is not a number")
    if ph == "X" and not (_is_number(e.get("dur")) and e["dur"] >= 0):
        p.append(f"{where}: dur = {e.get('dur')!r} must be a number >= 0")
    if ph == "C" and not all(_is_number(v) for v in dict(e.get("args") or {}).values()):
        p.append(f"{where}: a counter's args must be numbers, got {e.get('args')!r}")
    if ph in ("b", "e") and ("cat" not in e or "id" not in e):
        p.append(f"{where}: an async event needs 'cat' and 'id'")
    if ph == "M" and e.get("name") not in ("process_name", "thread_name"):
        p.append(f"{where}: metadata must name a process or a thread")
    if ph not in ("X", "C", "b", "e", "M", "i"):
        p.append(f"{where}: unknown phase {ph!r}")
    return p


def schema_problems(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every event's fields, and every async end matching an open begin."""
    problems = [
        p for i, e in enumerate(events) if isinstance(e, Mapping) for p in _event_problems(i, e)
    ]
    problems += [
        f"event {i}: not an object" for i, e in enumerate(events) if not isinstance(e, Mapping)
    ]
    open_spans: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for e in sorted(events, key=lambda e: (e.get("ts", 0), e.get("ph") == "e")):
        key = (e.get("cat"), e.get("id"), e.get("name"))
        if e.get("ph") == "b":
            open_spans[key] += 1
        elif e.get("ph") == "e":
            if open_spans[key] == 0:
                problems.append(f"async end {key} at ts {e.get('ts')} closes no begin")
            else:
                open_spans[key] -= 1
    return problems


def lanes(events: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], str]:
    """(process id, thread id) -> lane name, from the "M" events."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def overlap_problems(events: Sequence[Mapping[str, Any]], slack_us: float = 100.0) -> list[str]:
    """Spans ("X") of one lane must nest: each ends before its parent does (`slack_us`: a
    phase's span ends at the clock's reading just after its duration's, microseconds apart)."""
    by_lane: dict[tuple[Any, Any], list[Mapping[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_lane[(e["pid"], e["tid"])].append(e)
    names = lanes(events)
    problems: list[str] = []
    for lane, spans in by_lane.items():
        stack: list[Mapping[str, Any]] = []
        for s in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= s["ts"] + slack_us:
                stack.pop()
            if stack and s["ts"] + s["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + slack_us:
                parent = stack[-1]
                problems.append(
                    f"lane {names.get(lane, lane)!r}: {s['name']!r} at {s['ts']:.0f} overlaps "
                    f"{parent['name']!r} ({parent['ts']:.0f} + {parent['dur']:.0f} us)"
                )
            stack.append(s)
    return problems


def step_spans(
    events: Sequence[Mapping[str, Any]], lane: str = "driver"
) -> dict[int, dict[str, float]]:
    """Step number -> {phase: seconds} of the phase spans inside that step's span, plus
    `step` (the step span's own seconds)."""
    keys = {key for key, name in lanes(events).items() if name == lane}
    spans = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in keys]
    out: dict[int, dict[str, float]] = {}
    for step in (s for s in spans if s["name"].startswith("step ")):
        number = int(step["name"].split()[1])
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [
            s
            for s in spans
            if s is not step
            and start - 1 <= s["ts"]
            and s["ts"] + s["dur"] <= end + 1
            and s["name"] in PHASES
        ]
        phases: dict[str, float] = {"step": step["dur"] / 1e6}
        for s in inside:
            phases[s["name"]] = phases.get(s["name"], 0.0) + s["dur"] / 1e6
        out[number] = phases
    return out


def phase_problems(
    events: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], tolerance: float = 0.05
) -> list[str]:
    """Each step's phase spans against its metrics.jsonl row: the sum of the phases, and the
    step, within `tolerance` of `time/<phase>_s` and `perf/step_time_s`."""
    spans = step_spans(events)
    problems: list[str] = []
    for row in rows:
        step = int(row.get("step", 0))
        if step == 0 or "perf/step_time_s" not in row:
            continue
        if step not in spans:
            problems.append(f"step {step}: no span in the trace")
            continue
        traced = spans[step]
        logged = sum(float(row.get(f"time/{k}_s", 0.0)) for k in PHASES)
        summed = sum(v for k, v in traced.items() if k != "step")
        for what, a, b in (
            ("phases", summed, logged),
            ("step", traced["step"], float(row["perf/step_time_s"])),
        ):
            if abs(a - b) > tolerance * max(b, 1e-9):
                problems.append(f"step {step}: {what} {a:.4f} s traced against {b:.4f} s logged")
    return problems
