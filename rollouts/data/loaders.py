"""JSONL datasets: prompts (for RL) and conversations (for SFT).

A malformed line is an error that names the file, the line number and what is wrong; an empty
dataset is an error. Nothing is skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollouts.types import Message, PromptItem

VALID_ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A dataset file that cannot be read as asked; the message names file and line."""


def _read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                msg = f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                raise DatasetError(msg) from e
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}"
                )
            yield lineno, row


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
    return tuple(messages)


def load_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    label_key: str = "label",
    messages_key: str = "messages",
) -> list[PromptItem]:
    """Read a prompt dataset: each line has `prompt` (text) or `messages` (chat), and a label."""
    items: list[PromptItem] = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        if prompt_key in row:
            prompt = row[prompt_key]
            if not isinstance(prompt, str) or not prompt:
                raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string")
        elif messages_key in row:
            prompt = _check_messages(row[messages_key], where)
        else:
            raise DatasetError(
                f"{where}: needs a {prompt_key!r} (text) or {messages_key!r} (chat) field; "
                f"found keys {sorted(row)}"
            )
        extra = {k: v for k, v in row.items() if k not in (prompt_key, messages_key, label_key)}
        items.append(
            PromptItem(index=len(items), prompt=prompt, label=row.get(label_key), metadata=extra)
        )
    if not items:
        raise DatasetError(f"{path}: the dataset is empty")
    return items


def load_conversations(
    path: str | Path, messages_key: str = "messages"
) -> list[tuple[Message, ...]]:
    """Read an SFT dataset: each line has `messages`, with at least one assistant turn."""
    conversations: list[tuple[Message, ...]] = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        if messages_key not in row:
            raise DatasetError(f"{where}: needs a {messages_key!r} field; found keys {sorted(row)}")
        messages = _check_messages(row[messages_key], where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError(f"{where}: no assistant message, so nothing to train on")
        conversations.append(messages)
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
