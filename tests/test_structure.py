"""The code's shape holds (scripts/structure.py, ast over rollouts/): no room cycle, no upward
import, no module over 400 lines, no function over 60, no mode passed as a bare `str`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rooms_import_downward_and_the_limits_hold() -> None:
    m = _structure().measure()
    assert m["room_cycles"] == [], m["cycle_edges"]
    assert m["upward_imports"] == []
    assert m["long_modules"] == []
    assert m["long_functions"] == []
    assert m["str_modes"] == []


def test_the_layers_and_the_cycle_finder() -> None:
    """What the measure rests on: the loop sits above the trainer, a module's room is its folder,
    and two rooms that import each other are a cycle."""
    structure = _structure()
    assert structure._layer("loop") > structure._layer("trainer")
    assert structure.room_of("rollouts.trainer.core") == "trainer"
    assert structure.room_of("rollouts.types") == "rollouts"
    assert structure._cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
