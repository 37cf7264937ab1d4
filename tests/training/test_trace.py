"""The timeline of a real run (`logging.trace = true`, issue 49): the shared tiny sft+rl run's
trace.json in the trace format, its lanes' spans nested, each RL step's phase spans within 5% of
its logged phase times, and each sample's life from queued to trained."""

from __future__ import annotations

import collections
import json

from rollouts.trace_check import lanes, overlap_problems, phase_problems, schema_problems
from rollouts.tracing import load_trace
from tests.training.conftest import FinishedRun


def test_the_runs_trace_holds_its_steps_lanes_and_samples(finished_run: FinishedRun) -> None:
    run = finished_run.run
    events = load_trace(run / "trace.json")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert schema_problems(events) == []
    assert overlap_problems(events) == []
    assert phase_problems(events, rows, tolerance=0.05) == []
    names = set(lanes(events).values())
    assert {"driver", "trainer", "weight sync"} <= names, names
    assert any(n.startswith("engine http://127.0.0.1:") for n in names), names
    spans = collections.Counter(
        (lanes(events)[(e["pid"], e["tid"])].split(" http")[0], e["name"])
        for e in events
        if e["ph"] == "X"
    )
    assert spans[("driver", "step 3")] == 1 and spans[("driver", "sync")] == 3, spans
    assert spans[("trainer", "forward")] == spans[("trainer", "backward")] >= 3 + 6  # RL + SFT
    assert spans[("trainer", "optimizer step")] == 3 + 6, spans
    assert spans[("engine", "weight load")] == 3 and spans[("engine", "content check")] == 3
    ended = [e["args"] for e in events if e["ph"] == "e" and e["name"] == "sample"]
    trained = [a for a in ended if a["status"] == "trained"]
    assert len(trained) == len((run / "rollouts.jsonl").read_text().splitlines()) == 12
    assert sorted(a["step"] for a in trained) == [1] * 4 + [2] * 4 + [3] * 4
    for stage in ("generate", "reward"):
        assert sum(e["name"] == stage and e["ph"] == "e" for e in events) >= 12, stage
