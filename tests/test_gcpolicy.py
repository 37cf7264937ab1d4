"""`gcpolicy.freeze_startup_objects`: garbage is collected first, the survivors leave the
generations a full collection walks."""

from __future__ import annotations

import gc
import weakref

import pytest

from rollouts.gcpolicy import freeze_startup_objects, gc_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_garbage_is_collected_and_the_survivors_are_frozen() -> None:
    gc.disable()  # no automatic collection in between: only the ones this test makes
    kept = [_Node() for _ in range(100)]
    gc.collect()
    walked_before = len(gc.get_objects(generation=2))
    dropped = _Node()
    gone = weakref.ref(dropped)
    del dropped
    assert gone() is not None  # garbage, waiting for a collection
    try:
        frozen = freeze_startup_objects()
        assert gone() is None  # collected, not frozen
        assert frozen > walked_before / 2  # (the count falls as frozen objects are freed)
        assert len(gc.get_objects(generation=2)) < walked_before / 10
        assert not any(o is kept for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
        gc.enable()


def test_gc_paused_turns_the_collector_back_on_as_it_was_even_after_an_error() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("a bad answer")
    assert gc.isenabled()
    gc.disable()  # off before: it stays off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
