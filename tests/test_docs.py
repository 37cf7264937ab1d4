"""Docs that stay true: every path, module and config key the docs name exists, and they link
nothing outside the repository."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from rollouts.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    ROOT / "README.md",
    ROOT / "docs" / "architecture.md",
    ROOT / "docs" / "benchmarks.md",
    ROOT / "docs" / "scaling.md",
)
TOP_DIRS = ("rollouts/", "scripts/", "configs/", "docs/", "tests/", "examples/",
            "integration_training/", ".ci/")  # fmt: skip
FILE_ENDINGS = (".py", ".sh", ".toml", ".md")
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[\w./*-]+")
KEY = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_]+)+)(?![\w(/-])")
HELPERS = {"bench_timing.py", "bench_rl_floor.py"}  # imported by the benchmarks, not run
PLACEHOLDERS = {"configs/X.toml"}
NOT_KEYS = {"model.generate"}  # transformers' method, not the [model] section


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _spans(text: str) -> list[str]:
    """Inline code spans and the lines of code blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.DOTALL)
    return SPAN.findall(prose) + [line for block in blocks for line in block.splitlines()]


def _repo_paths(span: str) -> list[str]:
    """Tokens of `span` that name a file or folder of the repository."""
    out = []
    for token in PATH.findall(span.split(":")[0]):
        token = token.rstrip(".")
        if "*" in token or token in PLACEHOLDERS or token in FILE_ENDINGS:
            continue  # a glob, a placeholder or a bare file ending
        if token.startswith(TOP_DIRS) or token.endswith(FILE_ENDINGS):
            out.append(token)
    return out


def _exists(token: str) -> bool:
    """A path from the root, from rollouts/ or inference/, or a file name found in the tree."""
    bases = (ROOT, ROOT / "rollouts", ROOT / "rollouts" / "inference")
    if any((base / token).exists() for base in bases):
        return True
    if "/" not in token.rstrip("/"):
        return any(any(ROOT.glob(f"{top}**/{token}")) for top in TOP_DIRS)
    return False


def test_every_path_the_docs_name_exists() -> None:
    missing = [
        f"{doc.name}: {token}"
        for doc in DOCS
        for span in _spans(_text(doc))
        for token in _repo_paths(span)
        if not _exists(token)
    ]
    assert not missing, missing


def test_every_rollouts_module_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        for name in re.findall(r"\brollouts(?:\.\w+)+", _text(doc)):
            parts = name.split(".")
            if parts[-1] in ("json", "jsonl"):
                continue  # a run directory's file (rollouts.jsonl)
            found = any(
                (ROOT.joinpath(*parts[:n]).with_suffix(".py")).is_file()
                or (ROOT.joinpath(*parts[:n]) / "__init__.py").is_file()
                for n in range(2, len(parts) + 1)
            )
            if not found:
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing


def test_the_rooms_table_names_each_rooms_own_modules() -> None:
    """In architecture.md's table of rooms, every module of a row is in that row's folder."""
    missing = []
    for line in _text(ROOT / "docs" / "architecture.md").splitlines():
        cells = line.split("|")
        folder = re.fullmatch(r"\s*`(rollouts/[\w/]*)`\s*", cells[1]) if len(cells) > 3 else None
        if folder is None:
            continue
        for module in re.findall(r"`(\w+\.py)`", cells[3]):
            if not (ROOT / folder.group(1) / module).is_file():
                missing.append(f"{folder.group(1)}{module}")
    assert not missing, missing


def _rooms_table() -> dict[str, set[str]]:
    """architecture.md's rooms table: each row's folder and the module files it names."""
    rows: dict[str, set[str]] = {}
    for line in _text(ROOT / "docs" / "architecture.md").splitlines():
        cells = line.split("|")
        folder = re.fullmatch(r"\s*`(rollouts/[\w/]*)`\s*", cells[1]) if len(cells) > 3 else None
        if folder is not None:
            rows[folder.group(1)] = set(re.findall(r"`(\w+\.py)`", cells[3]))
    return rows


def test_the_rooms_table_names_every_module() -> None:
    """The map is whole: every module of `rollouts/` is in the row of its own folder."""
    rows = _rooms_table()
    left_out = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "rollouts").rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and path.name not in rows.get(f"{path.parent.relative_to(ROOT)}/", set())
    ]
    assert not left_out, f"docs/architecture.md's rooms table leaves out {left_out}"


def _resolves(key: str) -> bool:
    """`section.key[.key]` names a field of the Config tree."""
    node: object = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return False  # a key below a plain value
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        node = fields[part].default_factory if callable(fields[part].default_factory) else None
    return True


def test_every_config_key_the_docs_name_exists() -> None:
    sections = {f.name for f in dataclasses.fields(Config)}
    unknown = []
    for doc in DOCS:
        for span in _spans(_text(doc)):
            for key in KEY.findall(span):
                if key in NOT_KEYS or key.endswith(FILE_ENDINGS):
                    continue
                if key.split(".")[0] in sections and not _resolves(key):
                    unknown.append(f"{doc.name}: {key}")
    assert not unknown, unknown


def test_the_docs_link_nothing_outside_the_repository() -> None:
    for doc in DOCS:
        text = _text(doc)
        assert "../" not in text, f"{doc.name} points outside the repository"
        assert not re.search(r"\]\((?!#|docs/|[\w-]+\.md)", text), f"{doc.name}: an outside link"
        assert not re.search(r"\bissues? \d+|#\d+\b", text), f"{doc.name} cites an issue number"


def test_every_benchmark_script_has_its_section() -> None:
    text = _text(ROOT / "docs" / "benchmarks.md")
    scripts = [p.name for p in (ROOT / "scripts").glob("bench_*.py") if p.name not in HELPERS]
    assert scripts
    missing = [name for name in scripts if f"scripts/{name}" not in text]
    assert not missing, missing
    readme = _text(ROOT / "README.md")
    assert "docs/architecture.md" in readme and "docs/benchmarks.md" in readme
