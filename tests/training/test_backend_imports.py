"""The backend modules import one way: building <- pytorch factory, building <- fsdp."""

from __future__ import annotations

import subprocess
import sys


def _loaded_after(*modules: str) -> list[set[str]]:
    """The modules loaded in a fresh interpreter after importing each of `modules` in turn (one
    interpreter: torch's import, most of the time, is paid once)."""
    code = "import importlib, sys\n"
    code += f"for name in {modules!r}:\n"
    code += "    importlib.import_module(name)\n    print(' '.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(modules), out.stdout[-2000:]
    return [set(line.split()) for line in lines]


def test_fsdp_does_not_import_the_factories_and_building_imports_neither():
    # building first: what fsdp adds to it is fsdp's (building is asserted to load neither)
    building, with_fsdp = _loaded_after("rollouts.trainer.building", "rollouts.trainer.fsdp")
    assert "rollouts.trainer.factories" not in building
    assert "rollouts.trainer.fsdp" not in building
    assert "rollouts.trainer.fsdp" in with_fsdp
    assert "rollouts.trainer.factories" not in with_fsdp
