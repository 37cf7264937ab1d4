"""What `logging.trace = true` costs a step: the events a real run's steps recorded, emitted and
written again here, against that run's step time.

    python scripts/bench_trace.py RUN_DIR     # a run made with --set logging.trace=true

It reads RUN_DIR/trace.json and metrics.jsonl, counts the events of each RL step (by kind: spans,
counters, async begins and ends), then times, in this process, a Tracer recording that many
events of those kinds and appending them to a file (the run's own path: `Tracer.complete`,
`counter`, `begin`/`end`, `flush`), and prints the cost per step against the run's mean step
time. It also checks the trace (format, nesting, phase sums) and prints its spans per lane.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

from rollouts import tracing
from rollouts.trace_check import lanes, overlap_problems, phase_problems, schema_problems
from rollouts.tracing import Tracer, load_trace


def per_step_events(events: list[dict], steps: int) -> collections.Counter:
    """Events of each kind a step recorded, on average (the RL steps' window)."""
    driver = {key for key, n in lanes(events).items() if n == "driver"}
    spans = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) in driver]
    rl = [s for s in spans if s["name"].startswith("step ")]
    start, end = min(s["ts"] for s in rl), max(s["ts"] + s["dur"] for s in rl)
    inside = [e for e in events if e.get("ts") is not None and start <= e["ts"] <= end]
    kinds = collections.Counter(e["ph"] for e in inside)
    return collections.Counter({k: v / steps for k, v in kinds.items()})


def emit(tracer: Tracer, kinds: collections.Counter, step: int) -> None:
    """One step's worth of events of each kind, as the run records them."""
    now = tracing.now_us()
    for i in range(round(kinds["X"])):
        tracer.complete("trainer", "forward", now + i, now + i + 1, micro_batch=i, tokens=512)
    for i in range(round(kinds["C"])):
        tracer.counter("engine http://127.0.0.1:30000", "requests in flight", i % 64)
    for i in range(round(kinds["b"])):
        tracer.begin("sample", f"g{step}.s{i}", "generate", group=step, prompt=i, batch=step)
    for i in range(round(kinds["e"])):
        tracer.end("sample", f"g{step}.s{i}", "generate", status="completed", tokens=24)
    tracer.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    events = load_trace(args.run / "trace.json")
    rows = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_time_s" in r]
    problems = schema_problems(events) + overlap_problems(events) + phase_problems(events, rows)
    print(f"trace: {len(events)} events, {len(problems)} problem(s)")
    for p in problems[:5]:
        print(f"  {p}")
    names = lanes(events)
    per_lane = collections.Counter(
        names.get((e["pid"], e["tid"]), "?").split(" http")[0] for e in events if e["ph"] == "X"
    )
    print("spans per lane: " + ", ".join(f"{k} {v}" for k, v in sorted(per_lane.items())))
    asyncs = collections.Counter(e["name"] for e in events if e["ph"] == "b")
    print(
        "async spans (each sample's life, its stages): "
        + ", ".join(f"{k} {v}" for k, v in sorted(asyncs.items()))
    )
    kinds = per_step_events(events, len(rows))
    step_s = statistics.mean(r["perf/step_time_s"] for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        tracer = Tracer(Path(tmp) / "trace.json")
        emit(tracer, kinds, 0)  # warm
        started = time.perf_counter()
        for k in range(args.repeats):
            emit(tracer, kinds, k + 1)
        cost_s = (time.perf_counter() - started) / args.repeats
    shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items()))
    print(f"events a step ({len(rows)} RL steps): {shown}")
    print(
        f"mean step {step_s * 1e3:.1f} ms; recording and writing a step's events "
        f"{cost_s * 1e3:.3f} ms: overhead ratio {cost_s / step_s:.4f}"
    )


if __name__ == "__main__":
    main()
