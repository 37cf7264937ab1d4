"""Writing a test's run config: base sections, overridden per test, as a TOML file."""

from __future__ import annotations

import json
from pathlib import Path


def write_config(path: Path, base: dict[str, dict], sections: dict[str, dict]) -> Path:
    """`base` updated by `sections` (a key `a__b` names section `a.b`), written to `path`."""
    for key, value in sections.items():
        base.setdefault(key.replace("__", "."), {}).update(value)
    lines = []
    for section, table in base.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    assert path.read_text().startswith("["), f"{path} has no section"
    return path
