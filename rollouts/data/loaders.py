"""Datasets: prompts (for RL) and conversations (for SFT), from any source `sources.py` reads
(JSONL, JSON, parquet, a `datasets` directory, a hub name), with a column map (`Columns`).

A malformed record (bytes that are not UTF-8, bad JSON, a missing or empty column, a prompt that
is neither text nor chat messages) is an error that names the source, the row and the column;
every bad row of a source is reported in one error (the first `MAX_REPORTED`, then how many more).
A column missing from a columnar source (parquet, `datasets`) is one error naming the columns it
has. An empty dataset is an error. Nothing is skipped silently. Prompts too long for the model
are dropped at load, counted and printed (`drop_overlong_prompts`, as verl's
`filter_overlong_prompts`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rollouts.data.sources import DatasetError, Table, open_table
from rollouts.types import Message, PromptItem

__all__ = ["MAX_REPORTED", "Columns", "DatasetError", "load_conversations", "load_prompts"]

VALID_ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 10  # bad rows named in one DatasetError; the rest are counted
SOURCE_KEY = "source"  # metadata naming the [[data.sources]] entry a prompt came from


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """Which column holds what. A key may be dotted to reach into a nested column
    (verl's parquet: `label = "reward_model.ground_truth"`); `label = ""`: no labels;
    `metadata = ()`: every other column is kept as metadata."""

    prompt: str = "prompt"
    messages: str = "messages"
    label: str = "label"
    metadata: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.prompt or self.messages, f"{self=}: needs a prompt or a messages column"


def _get(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of column `key`, a dotted key walking into nested objects."""
    if key in row:
        return True, row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return "." in key, node


def _rows(table: Table, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The table's rows; an unreadable one goes to `problems`."""
    for where, row in table.rows:
        if isinstance(row, DatasetError):
            problems.append(str(row))
        else:
            yield where, row


def _raise_problems(path: str | Path, problems: Sequence[str]) -> None:
    """One DatasetError naming every bad row (the first MAX_REPORTED, then a count)."""
    if not problems:
        return
    if len(problems) == 1:
        raise DatasetError(problems[0])
    shown = "\n".join(f"  {p}" for p in problems[:MAX_REPORTED])
    more = len(problems) - MAX_REPORTED
    rest = f"\n  ... and {more} more bad row(s)" if more > 0 else ""
    raise DatasetError(f"{path}: {len(problems)} bad rows:\n{shown}{rest}")


def _check_columns(table: Table, columns: Columns, *, conversations: bool = False) -> None:
    """A columnar source must have the columns asked for: one error naming what it has."""
    if table.columns is None:
        return
    have = set(table.columns)

    def has(key: str) -> bool:
        return bool(key) and (key in have or key.split(".")[0] in have)

    missing: list[str] = []
    if conversations and not has(columns.messages):
        missing.append(f"{columns.messages!r} (data.messages_key)")
    if not conversations and not (has(columns.prompt) or has(columns.messages)):
        missing.append(
            f"{columns.prompt!r} (data.prompt_key) or {columns.messages!r} (data.messages_key)"
        )
    if not conversations and columns.label and not has(columns.label):
        missing.append(f'{columns.label!r} (data.label_key; set it to "" for no labels)')
    missing += [f"{k!r} (data.metadata_keys)" for k in columns.metadata if not has(k)]
    if missing:
        raise DatasetError(
            f"{table.name}: no column {', no column '.join(missing)}; its columns: "
            f"{sorted(have)}. Name the right ones in [data] (or in the [[data.sources]] entry)"
        )


def _is_blank(text: str) -> bool:
    return not text.strip()


def _message(m: Any, i: int, where: str) -> Message:
    """Message `i` checked; keys a columnar source fills with None for rows without them
    (`tool_calls` of a plain turn) are dropped, as the JSONL row would not have them."""
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise DatasetError(f"{where}: message {i} must be an object with 'role' and 'content'")
    m = {k: v for k, v in m.items() if v is not None or k == "content"}
    if m["role"] not in VALID_ROLES:
        raise DatasetError(
            f"{where}: message {i} has role {m['role']!r}; valid roles: {list(VALID_ROLES)}"
        )
    if m["content"] is None and m.get("tool_calls"):
        m["content"] = ""  # a tool call needs no text
    if not isinstance(m["content"], str):
        raise DatasetError(f"{where}: message {i} content must be a string")
    if _is_blank(m["content"]) and not m.get("tool_calls"):
        raise DatasetError(
            f"{where}: message {i} ({m['role']}) has an empty 'content' (an empty prompt is "
            "refused too): give it text or leave the message out"
        )
    return m


def _check_messages(messages: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: must be a non-empty list of {{role, content}} messages")
    return tuple(_message(m, i, where) for i, m in enumerate(messages))


def _described(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _prompt_of(row: dict[str, Any], where: str, columns: Columns) -> Any:
    """The prompt: text, or chat messages (from the prompt column, as verl's parquet holds
    them, or from the messages column)."""
    found, prompt = _get(row, columns.prompt) if columns.prompt else (False, None)
    key = columns.prompt
    if not found and columns.messages:
        found, prompt = _get(row, columns.messages)
        key = columns.messages
    if not found:
        asked = " or ".join(
            f"{k!r} (data.{name})"
            for k, name in ((columns.prompt, "prompt_key"), (columns.messages, "messages_key"))
            if k
        )
        raise DatasetError(
            f"{where}: no column {asked}; the row's columns: {sorted(row)}: name the prompt's "
            "column in data.prompt_key"
        )
    if isinstance(prompt, list):
        return _check_messages(prompt, f"{where}, column {key!r}")
    if key == columns.prompt and isinstance(prompt, str) and not _is_blank(prompt):
        return prompt
    wanted = (
        "a list of {role, content} messages"
        if key != columns.prompt
        else ("a non-empty string or a list of {role, content} messages")
    )
    raise DatasetError(f"{where}, column {key!r}: must be {wanted}, got {_described(prompt)}")


def _metadata(row: dict[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    if not columns.metadata:
        used = {columns.prompt, columns.messages, columns.label}
        return {k: v for k, v in row.items() if k not in used}
    out: dict[str, Any] = {}
    for key in columns.metadata:
        found, value = _get(row, key)
        if not found:
            raise DatasetError(f"{where}: no column {key!r} (data.metadata_keys)")
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChatWrap:
    """A text prompt made a user message: `user_template` with {prompt} replaced by the text,
    after a system message when `system_prompt` is set (empty template: text stays text)."""

    user_template: str = ""
    system_prompt: str = ""

    def __post_init__(self) -> None:
        assert not self.user_template or "{prompt}" in self.user_template, f"{self=}"

    def __call__(self, prompt: Any) -> Any:
        if not self.user_template or not isinstance(prompt, str):
            return prompt
        user = {"role": "user", "content": self.user_template.replace("{prompt}", prompt)}
        system = ({"role": "system", "content": self.system_prompt},) if self.system_prompt else ()
        return (*system, user)


def _prompt_item(
    row: dict[str, Any], where: str, columns: Columns, index: int, source: str, wrap: ChatWrap
) -> PromptItem:
    prompt = wrap(_prompt_of(row, where, columns))
    label = _get(row, columns.label)[1] if columns.label else None
    metadata = _metadata(row, where, columns)
    if source:
        metadata[SOURCE_KEY] = source
    return PromptItem(index=index, prompt=prompt, label=label, metadata=metadata)


def load_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    label_key: str = "label",
    messages_key: str = "messages",
    *,
    metadata_keys: Sequence[str] = (),
    split: str = "",
    subset: str = "",
    source: str = "",
    first_index: int = 0,
    wrap: ChatWrap = ChatWrap(),
) -> list[PromptItem]:
    """Read a prompt dataset: each row has a prompt (text or chat messages) and a label, in the
    columns named. `source` (a mixture's entry) is kept in each item's metadata; indices start
    at `first_index` (a mixture's sources follow each other); `wrap` makes text prompts chat."""
    columns = Columns(
        prompt=prompt_key, label=label_key, messages=messages_key, metadata=tuple(metadata_keys)
    )
    table = open_table(str(path), split, subset)
    _check_columns(table, columns)
    items: list[PromptItem] = []
    problems: list[str] = []
    for where, row in _rows(table, problems):
        try:
            items.append(_prompt_item(row, where, columns, first_index + len(items), source, wrap))
        except DatasetError as e:
            problems.append(str(e))
    _raise_problems(table.name, problems)
    if not items:
        raise DatasetError(f"{table.name}: the dataset is empty")
    return items


def _conversation_of(row: dict[str, Any], where: str, messages_key: str) -> tuple[Message, ...]:
    found, messages = _get(row, messages_key)
    if not found:
        raise DatasetError(f"{where}: no column {messages_key!r}; the row's columns: {sorted(row)}")
    messages = _check_messages(messages, f"{where}, column {messages_key!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message, so nothing to train on")
    return messages


def load_conversations(
    path: str | Path, messages_key: str = "messages", *, split: str = "", subset: str = ""
) -> list[tuple[Message, ...]]:
    """Read an SFT dataset: each row has chat messages, with at least one assistant turn."""
    table = open_table(str(path), split, subset)
    _check_columns(table, Columns(messages=messages_key, label=""), conversations=True)
    conversations: list[tuple[Message, ...]] = []
    problems: list[str] = []
    for where, row in _rows(table, problems):
        try:
            conversations.append(_conversation_of(row, where, messages_key))
        except DatasetError as e:
            problems.append(str(e))
    _raise_problems(table.name, problems)
    if not conversations:
        raise DatasetError(f"{table.name}: the dataset is empty")
    return conversations


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSONL (used by the demo's synthetic task and by tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
