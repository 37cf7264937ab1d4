"""The run's timeline (`rollouts/tracing.py`, issue 49): the trace event format, lanes whose spans
nest, async spans for what overlaps, a file that opens after a kill, and a trainer process that
writes its lane into its driver's file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rollouts import tracing
from rollouts.trace_check import lanes, overlap_problems, schema_problems
from rollouts.tracing import Tracer, load_trace


@pytest.fixture
def tracer(tmp_path: Path):
    tracer = Tracer(tmp_path / "trace.json")
    token = tracing.install(tracer)
    yield tracer
    tracing._CURRENT.reset(token)


def test_spans_nest_in_their_lanes_and_the_file_opens_unclosed(tracer: Tracer) -> None:
    with tracing.span("driver", "step 1"):
        with tracing.span("driver", "generate"):
            tracing.engine_load("http://e0", 3)
        tracing.phase("train", 0.0005)
    tracer.counter("engine http://e0", "requests in flight", 0)
    tracer.flush()
    text = tracer.path.read_text()
    assert text.startswith("[\n") and not text.rstrip().endswith("]")  # open: a kill keeps it
    events = load_trace(tracer.path)
    assert schema_problems(events) == [] and overlap_problems(events) == []
    names = lanes(events)
    assert sorted(names.values()) == ["driver", "engine http://e0"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    step, generate, train = spans["step 1"], spans["generate"], spans["train"]
    assert step["ts"] <= generate["ts"] and train["ts"] + train["dur"] <= step["ts"] + step["dur"]
    assert train["dur"] == pytest.approx(500.0)
    counters = [e["args"]["value"] for e in events if e["ph"] == "C"]
    assert counters == [3, 0]


def test_an_overlap_in_a_lane_is_found(tracer: Tracer) -> None:
    now = tracing.now_us()
    tracer.complete("trainer", "forward", now, now + 1000)
    tracer.complete("trainer", "backward", now + 500, now + 2000)  # starts inside, ends after
    tracer.complete("driver", "generate", now + 500, now + 2000)  # another lane: fine
    tracer.flush()
    (problem,) = overlap_problems(load_trace(tracer.path))
    assert "lane 'trainer': 'backward'" in problem and "overlaps 'forward'" in problem


def test_a_samples_life_nests_its_stages_and_close_ends_what_is_open(tracer: Tracer) -> None:
    from rollouts.types import Sample

    group = tuple(Sample(index=7, group_index=3, prompt="q") for _ in range(2))
    queued = tracing.samples_queued(group, batch=1)
    assert [s.metadata[tracing.SAMPLE_KEY] for s in queued] == ["g3.s0", "g3.s1"]
    assert tracing.samples_queued(queued, batch=2) == queued  # a partial group goes on
    tracing.samples_stage(queued, "generate", begin=True)
    tracing.samples_stage(queued, "generate", begin=False)
    tracing.samples_trained([queued], [queued[:1]], step=1)
    tracer.close()
    events = load_trace(tracer.path)
    assert schema_problems(events) == []
    ends = {(e["id"], e["name"]): e["args"] for e in events if e["ph"] == "e"}
    assert ends[("g3.s0", "sample")]["status"] == "trained"
    assert ends[("g3.s1", "sample")]["status"] == "not trained: pending"
    assert ends[("g3.s0", "generate")]["status"] == "pending"
    begins = [e for e in events if e["ph"] == "b" and e["name"] == "sample"]
    assert len(begins) == 2 and begins[0]["args"] == {"group": 3, "prompt": 7, "batch": 1}


def test_an_end_without_a_begin_is_a_schema_problem(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    event = {"ph": "e", "cat": "sample", "id": "g1.s0", "name": "sample", "pid": 1, "tid": 0}
    path.write_text("[\n" + json.dumps(event | {"ts": 5}) + ",\n")
    (problem,) = schema_problems(load_trace(path))
    assert "closes no begin" in problem
    assert "ts = 'x' is not a number" in schema_problems([event | {"ts": "x"}])[0]


@pytest.mark.slow
def test_a_trainer_process_writes_its_lane_into_the_drivers_file(
    tiny_model_dir: Path, tracer: Tracer
) -> None:
    from rollouts.trainer.process import TrainerProcess
    from tests.training.backend_helpers import LENGTHS, make_batch, nll_loss, tiny_config

    tracer.complete("driver", "before", tracing.now_us(), tracing.now_us())
    tracer.flush()
    host = TrainerProcess(threads=1)
    try:
        remote = host.create(tiny_config(tiny_model_dir, micro_batch_tokens=24), total_steps=2)
        remote.forward_backward(make_batch(LENGTHS), nll_loss).result()
        remote.optim_step().result()
        remote.close()
    finally:
        host.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "optimizer step" not in tracer.path.read_text():
        time.sleep(0.05)
    events = load_trace(tracer.path)
    assert schema_problems(events) == [] and overlap_problems(events) == []
    (trainer,) = [key for key, name in lanes(events).items() if name == "trainer"]
    assert trainer[0] == host.pid != os.getpid()  # the child's own trace process
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {f"driver (pid {os.getpid()})", f"trainer process (pid {host.pid})"}
    child = [e["name"] for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == trainer]
    assert child.count("forward") == child.count("backward") > 1  # one per micro-batch
    assert child[-1] == "optimizer step"
