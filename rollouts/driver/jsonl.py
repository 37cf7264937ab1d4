"""Reading the run's JSONL files (metrics, rollouts) back: one reader for the driver, which
resumes from them, and for `rollouts show`, which must not import torch (this module imports
nothing of the project)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of `path` and whether its last line was torn (a crash or a run mid-write: that
    line is left out). A bad line before the last is an error naming the file and the line."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if any(rest.strip() for rest in lines[number:]):
                raise ValueError(f"{path}:{number}: not a JSON line ({e}); fix or delete it") from e
            return rows, True
    return rows, False
