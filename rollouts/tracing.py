"""A timeline of a run, in the Chrome trace event format (`trace.json`; ui.perfetto.dev and
chrome://tracing open it): `logging.trace = true`.

Lanes are the threads of a trace process (one per OS process: the driver, a trainer process, a
resumed run's driver): `driver` (each step and its phases), `engine <i>`
(requests in flight, pauses, sleeps, weight loads), `trainer` (forward/backward per micro-batch,
the optimizer step, checkpoint writes), `weight sync` (write, load, content check) and `rewards`.
Spans of a lane nest and never overlap ("X" events); what overlaps by nature (the samples, each
from queued to trained or dropped; reward calls) is an async span ("b"/"e" with an id), and a
level over time (requests in flight) a counter ("C").

A `Tracer` buffers events and appends them to the file at each `flush` (the driver flushes once
a step): the JSON Array Format, whose closing bracket may be missing, so a killed run's trace
still opens. A trainer process appends its own events to the same file (`O_APPEND`, one write a
flush). Timestamps are CLOCK_MONOTONIC microseconds: one clock for every process of the host.

The tracer of the running code is a context variable (`current()`), set once by the driver (and
by a trainer process): trio tasks and worker threads inherit it, so the rooms that record spans
need no tracer argument, and with tracing off `current()` is None and a span costs one lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
TRACE_FILE = "trace.json"
FLUSH_EVENTS = 4096  # events buffered before a flush that nobody asked for

_CURRENT: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("tracer", default=None)


def now_us() -> float:
    """Microseconds on CLOCK_MONOTONIC (the same clock in every process of the host, and
    `time.monotonic()`'s)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) / 1000.0


class Tracer:
    """Collects trace events and appends them to `path` (see the module doc)."""

    def __init__(self, path: str | Path, process: str = "driver") -> None:
        self.path = Path(path)
        self._lock = threading.Lock()  # spans end in worker threads too
        self._events: list[dict[str, Any]] = []
        self._lanes: dict[str, int] = {}
        # a trace process per OS process: the driver, a trainer process, a resumed run's driver
        # (its lanes apart from the killed run's, whose events stay in the file)
        self.pid = os.getpid()
        self._next_lane = 0
        self._open: dict[tuple[str, str], dict[str, Any]] = {}  # async spans not ended yet
        name = f"{process} (pid {self.pid})"
        self._events.append(
            {"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "args": {"name": name}}
        )

    def lane(self, name: str) -> int:
        """The thread id of lane `name` (named in the trace the first time it is used)."""
        with self._lock:
            tid = self._lanes.get(name)
            if tid is None:
                self._next_lane += 1
                tid = self._lanes[name] = self._next_lane
                self._events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": self.pid,
                        "tid": tid,
                        "args": {"name": name},
                    }
                )
        return tid

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)
            full = len(self._events) >= FLUSH_EVENTS
        if full:
            self.flush()

    def complete(self, lane: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
        """A span of `lane` from `start_us` to `end_us` (an "X" event)."""
        assert end_us >= start_us, f"{name}: {end_us=} < {start_us=}"
        tid = self.lane(lane)
        event = {
            "ph": "X",
            "name": name,
            "pid": self.pid,
            "tid": tid,
            "ts": start_us,
            "dur": end_us - start_us,
        }
        if args:
            event["args"] = args
        self._add(event)

    def counter(self, lane: str, name: str, value: float) -> None:
        """A level of `lane` from now on (a "C" event): requests in flight, batch size."""
        self._add(
            {
                "ph": "C",
                "name": name,
                "pid": self.pid,
                "tid": self.lane(lane),
                "ts": now_us(),
                "args": {"value": value},
            }
        )

    def begin(self, category: str, key: str, name: str, **args: Any) -> None:
        """Async span `name` of `key` begins (a sample queued; its generation inside it):
        spans of one key nest on one track. A span already running is left as it is (a
        partial rollout resumed)."""
        event = {
            "ph": "b",
            "cat": category,
            "name": name,
            "id": key,
            "pid": self.pid,
            "tid": 0,
            "ts": now_us(),
            "args": args,
        }
        with self._lock:
            if (key, name) in self._open:
                return
            self._open[(key, name)] = event
        self._add(event)

    def end(self, category: str, key: str, name: str, **args: Any) -> None:
        """Async span `name` of `key` ends; nothing when it never began."""
        with self._lock:
            began = self._open.pop((key, name), None)
        if began is None:
            return
        self._add(
            {
                "ph": "e",
                "cat": category,
                "name": name,
                "id": key,
                "pid": self.pid,
                "tid": 0,
                "ts": now_us(),
                "args": args,
            }
        )

    def flush(self) -> None:
        """Append the buffered events to the file (one write: whole events or none)."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return
        text = json.dumps(events, separators=(",", ":"))[1:-1] + ",\n"  # one call: fast
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size == 0:
                text = "[\n" + text
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def close(self, status: str = "unfinished") -> None:
        """End the async spans still open (`status`), innermost first, and flush."""
        with self._lock:
            still = sorted(self._open.items(), key=lambda kv: -kv[1]["ts"])
        for (key, name), event in still:
            self.end(event["cat"], key, name, status=status)
        self.flush()


def current() -> Tracer | None:
    """The tracer of the running code, or None when tracing is off."""
    return _CURRENT.get()


def install(tracer: Tracer | None) -> contextvars.Token:
    """Make `tracer` the current one (for this task and what it starts)."""
    return _CURRENT.set(tracer)


@contextlib.contextmanager
def span(lane: str, name: str, **args: Any) -> Iterator[None]:
    """Record the enclosed code as a span of `lane` (nothing when tracing is off)."""
    tracer = _CURRENT.get()
    if tracer is None:
        yield
        return
    start = now_us()
    try:
        yield
    finally:
        tracer.complete(lane, name, start, now_us(), **args)


def phase(
    name: str, seconds: float, lane: str = "driver", start_s: float | None = None, **args: Any
) -> float:
    """Record a phase that lasted `seconds` (as measured for its logged time, so the trace and
    `time/<name>_s` agree): from `start_s` (a `time.monotonic()` reading) when given, else
    ending now; returns `seconds`."""
    tracer = _CURRENT.get()
    if tracer is not None:
        start = start_s * 1e6 if start_s is not None else now_us() - seconds * 1e6
        tracer.complete(lane, name, start, start + seconds * 1e6, **args)
    return seconds


SYNC_LANE = "weight sync"


def engine_lane(url: str) -> str:
    """The lane of the engine at `url`."""
    return f"engine {url}"


def engine_load(url: str, in_flight: int) -> None:
    """The requests the driver has in flight on the engine at `url`, from now on."""
    tracer = _CURRENT.get()
    if tracer is not None:
        tracer.counter(engine_lane(url), "requests in flight", in_flight)


async def on_engine(url: str, name: str, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, recorded as a span of the engine's lane (its sleep, its wake-up)."""
    with span(engine_lane(url), name):
        return await awaitable


TRACE_ENV = "ROLLOUTS_TRACE"  # a child process's trace file (the trainer process)


def environment() -> dict[str, str]:
    """os.environ for a child process, naming the current trace file when there is one."""
    tracer = _CURRENT.get()
    env = {k: v for k, v in os.environ.items() if k != TRACE_ENV}
    if tracer is not None:
        env[TRACE_ENV] = str(tracer.path)
    return env


def from_environment() -> Tracer | None:
    """A child's tracer on the file its parent named (`environment`), or None."""
    path = os.environ.get(TRACE_ENV)
    return Tracer(path, process="trainer process") if path else None


def flush() -> None:
    """Write what the current tracer holds (the driver: once a step)."""
    tracer = _CURRENT.get()
    if tracer is not None:
        tracer.flush()


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file (a missing closing bracket and a trailing comma allowed)."""
    text = Path(path).read_text().rstrip()
    if text.endswith(","):
        text = text[:-1]
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


SAMPLE_KEY = "trace_id"  # sample.metadata: the sample's span id, while tracing (g<group>.s<i>)


def sample_begins(sample: Any, i: int, **args: Any) -> Any:
    """Sample `i` of its group queued: its span begins (a resumed one goes on); the sample with
    its span id in its metadata (itself when tracing is off)."""
    tracer = _CURRENT.get()
    if tracer is None:
        return sample
    key = sample.metadata.get(SAMPLE_KEY) or f"g{sample.group_index}.s{i}"
    tracer.begin("sample", key, "sample", group=sample.group_index, prompt=sample.index, **args)
    if SAMPLE_KEY in sample.metadata:
        return sample
    return dataclasses.replace(sample, metadata={**sample.metadata, SAMPLE_KEY: key})


def sample_stage(sample: Any, stage: str, begin: bool, **args: Any) -> None:
    """A stage of the sample's life (`generate`, `reward`) begins or ends, inside its span."""
    tracer = _CURRENT.get()
    key = sample.metadata.get(SAMPLE_KEY)
    if tracer is None or key is None:
        return
    if begin:
        tracer.begin("sample", key, stage, **args)
    else:
        tracer.end("sample", key, stage, **args)


def sample_ends(sample: Any, status: str, **args: Any) -> None:
    """The sample's life ends: trained, dropped (by a filter, as stale) or failed."""
    tracer = _CURRENT.get()
    key = sample.metadata.get(SAMPLE_KEY)
    if tracer is not None and key is not None:
        versions = list(getattr(sample, "weight_versions", ()) or ())
        tracer.end("sample", key, "sample", status=status, versions=versions, **args)


def samples_queued(group: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """While tracing: each sample's life begins (queued for batch `batch`)."""
    if _CURRENT.get() is None:
        return group
    return tuple(sample_begins(s, i, batch=batch) for i, s in enumerate(group))


def samples_stage(samples: Sequence[Any], stage: str, *, begin: bool) -> None:
    """While tracing: a stage (generate, reward) of each unfinished sample begins or ends."""
    if _CURRENT.get() is None:
        return
    for s in samples:
        args = {} if begin else {"status": s.status.value, "tokens": s.response_length}
        sample_stage(s, stage, begin, **args)


def samples_trained(
    seen: Sequence[Sequence[Any]], trained: Sequence[Sequence[Any]], step: int
) -> None:
    """While tracing: the life of each sample of the batch ends, trained at `step` or not (a
    FAILED or ABORTED sample, a stale group)."""
    if _CURRENT.get() is None:
        return
    kept = {id(s) for g in trained for s in g}
    for group in seen:
        for s in group:
            status = "trained" if id(s) in kept else f"not trained: {s.status.value}"
            sample_ends(s, status, step=step)
