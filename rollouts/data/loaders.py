"""JSONL datasets: prompts (for RL) and conversations (for SFT).

A malformed line (bytes that are not UTF-8, bad JSON, a missing or empty field) is an error that
names the file, the line number and what is wrong; every bad line of a file is reported in one
error (the first `MAX_REPORTED`, then how many more). An empty dataset is an error. Nothing is
skipped silently. Prompts too long for the model are dropped at load, counted and printed
(`drop_overlong_prompts`, as verl's `filter_overlong_prompts`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rollouts.types import Message, PromptItem

VALID_ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 10  # bad lines named in one DatasetError; the rest are counted


class DatasetError(ValueError):
    """A dataset file that cannot be read as asked; the message names file and line."""


def _decode(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line): "
            "save the file as UTF-8"
        ) from e


def _parse(raw: bytes, where: str, first: bool) -> dict[str, Any] | None:
    """One line as a JSON object (None for a blank line); DatasetError naming `where`."""
    line = _decode(raw, where, first)
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    return row


def _rows(path: str | Path, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:line`, row) of each JSON object line; a bad line goes to `problems`."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                row = _parse(raw, where, first=lineno == 1)
            except DatasetError as e:
                problems.append(str(e))
                continue
            if row is not None:
                yield where, row


def _raise_problems(path: str | Path, problems: Sequence[str]) -> None:
    """One DatasetError naming every bad line (the first MAX_REPORTED, then a count)."""
    if not problems:
        return
    if len(problems) == 1:
        raise DatasetError(problems[0])
    shown = "\n".join(f"  {p}" for p in problems[:MAX_REPORTED])
    more = len(problems) - MAX_REPORTED
    rest = f"\n  ... and {more} more bad line(s)" if more > 0 else ""
    raise DatasetError(f"{path}: {len(problems)} bad lines:\n{shown}{rest}")


def _is_blank(text: str) -> bool:
    return not text.strip()


def _check_messages(messages: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DatasetError(f"{where}: message {i} must be an object with 'role' and 'content'")
        if m["role"] not in VALID_ROLES:
            raise DatasetError(
                f"{where}: message {i} has role {m['role']!r}; valid roles: {list(VALID_ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise DatasetError(f"{where}: message {i} content must be a string")
        if _is_blank(m["content"]) and not m.get("tool_calls"):  # a tool call needs no text
            raise DatasetError(
                f"{where}: message {i} ({m['role']}) has an empty 'content' (an empty prompt is "
                "refused too): give it text or leave the message out"
            )
    return tuple(messages)


def _prompt_of(row: dict[str, Any], where: str, prompt_key: str, messages_key: str) -> Any:
    if prompt_key in row:
        prompt = row[prompt_key]
        if not isinstance(prompt, str) or _is_blank(prompt):
            raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string")
        return prompt
    if messages_key in row:
        return _check_messages(row[messages_key], where)
    raise DatasetError(
        f"{where}: needs a {prompt_key!r} (text) or {messages_key!r} (chat) field; "
        f"found keys {sorted(row)}"
    )


def load_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    label_key: str = "label",
    messages_key: str = "messages",
) -> list[PromptItem]:
    """Read a prompt dataset: each line has `prompt` (text) or `messages` (chat), and a label."""
    items: list[PromptItem] = []
    problems: list[str] = []
    for where, row in _rows(path, problems):
        try:
            prompt = _prompt_of(row, where, prompt_key, messages_key)
        except DatasetError as e:
            problems.append(str(e))
            continue
        extra = {k: v for k, v in row.items() if k not in (prompt_key, messages_key, label_key)}
        items.append(
            PromptItem(index=len(items), prompt=prompt, label=row.get(label_key), metadata=extra)
        )
    _raise_problems(path, problems)
    if not items:
        raise DatasetError(f"{path}: the dataset is empty")
    return items


def _conversation_of(row: dict[str, Any], where: str, messages_key: str) -> tuple[Message, ...]:
    if messages_key not in row:
        raise DatasetError(f"{where}: needs a {messages_key!r} field; found keys {sorted(row)}")
    messages = _check_messages(row[messages_key], where)
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message, so nothing to train on")
    return messages


def load_conversations(
    path: str | Path, messages_key: str = "messages"
) -> list[tuple[Message, ...]]:
    """Read an SFT dataset: each line has `messages`, with at least one assistant turn."""
    conversations: list[tuple[Message, ...]] = []
    problems: list[str] = []
    for where, row in _rows(path, problems):
        try:
            conversations.append(_conversation_of(row, where, messages_key))
        except DatasetError as e:
            problems.append(str(e))
    _raise_problems(path, problems)
    if not conversations:
        raise DatasetError(f"{path}: the dataset is empty")
    return conversations


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSONL (used by the demo's synthetic task and by tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
