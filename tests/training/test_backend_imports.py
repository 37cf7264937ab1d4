"""The backend modules import one way: building <- pytorch factory, building <- fsdp."""

from __future__ import annotations

import subprocess
import sys


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_fsdp_does_not_import_the_factories_and_building_imports_neither():
    assert "rollouts.trainer.factories" not in _loaded_after("rollouts.trainer.fsdp")
    building = _loaded_after("rollouts.trainer.building")
    assert "rollouts.trainer.factories" not in building
    assert "rollouts.trainer.fsdp" not in building
