"""The cyclic garbage collector in the long-lived processes: the driver, each built-in engine
server and the trainer process.

Set up, each holds a few hundred thousand long-lived objects (torch, transformers, the model),
and every full (generation 2) collection walks all of them while it holds the GIL: 120-280 ms
each, measured in the engine server and the driver, where the tiny model's async step is 0.75
s. `freeze_startup_objects` moves what exists once a process is set up to the permanent
generation, which collections skip; whatever is allocated later is collected as before. A
frozen object that later becomes garbage only through a reference cycle stays, so this is called
where what exists lives to the end: an engine server with its model loaded, the trainer process
with its backends built, the driver when the RL phase starts (not before SFT, whose backend goes).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_objects() -> int:
    """Collect what is garbage now, then freeze the survivors; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    assert frozen > 0, f"{frozen=}"
    return frozen


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off while building and reading back a large acyclic structure (an
    engine's answer: a list per generated token). Its temporaries are freed by reference counts
    before the collector is back on, so they are never counted toward a collection; with it on,
    each answer promoted thousands of lists to the old generation and set off full collections
    that walk the whole heap (`scripts/bench_driver.py`: seconds per 8k-sample step)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
