"""How many tokens a sample may have, and which setting says so.

A limit comes with its source (`model.max_position_embeddings = 128 (runs/x/base/config.json)`,
`data.max_length = 256`, `rollout.max_total_tokens = 1024`), so a refused sample names the
setting to change. The model's context is read from its config.json, not from the tokenizer's
`model_max_length` (1,000,000 on the tiny model: no limit at all).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from rollouts.types import PromptItem

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TokenLimit:
    """At most `tokens` tokens, because of `source` (a setting, with its value)."""

    tokens: int
    source: str

    def __post_init__(self) -> None:
        assert self.tokens >= 1, f"{self.tokens=} must be >= 1 ({self.source})"
        assert self.source, "a limit names its source"


def tightest(limits: Sequence[TokenLimit | None]) -> TokenLimit | None:
    """The smallest of the limits that are set (the first one on a tie); None when none is."""
    found = [limit for limit in limits if limit is not None]
    return min(found, key=lambda limit: limit.tokens) if found else None


def model_context(model_dir: str | Path) -> TokenLimit | None:
    """The model's positions from its config.json (`max_position_embeddings` or the like);
    None when the file names none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return TokenLimit(tokens=value, source=f"model.{key} = {value} ({path})")
    return None


def sft_limit(model_dir: str | Path, max_length: int) -> TokenLimit | None:
    """The longest SFT conversation: the model's context, and `data.max_length` when set."""
    assert max_length >= 0, f"{max_length=} must be >= 0"
    asked = None
    if max_length:
        asked = TokenLimit(tokens=max_length, source=f"data.max_length = {max_length}")
    return tightest([model_context(model_dir), asked])


def prompt_limit(model_dir: str | Path, max_total_tokens: int) -> TokenLimit:
    """Prompt + response of an RL sample: the model's context and `rollout.max_total_tokens`.

    A prompt must be shorter than this (room for at least one generated token)."""
    total = TokenLimit(
        tokens=max_total_tokens, source=f"rollout.max_total_tokens = {max_total_tokens}"
    )
    found = tightest([model_context(model_dir), total])
    assert found is not None
    return found


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PromptFilter:
    """What `drop_overlong_prompts` kept, and how many it dropped (the longest of them)."""

    kept: list[PromptItem]
    dropped: int
    longest_dropped: int
    limit: TokenLimit

    def describe(self, what: str) -> str:
        """One console line: `data.train_path: 3 of 1000 prompts dropped ...`."""
        total = len(self.kept) + self.dropped
        return (
            f"{what}: {self.dropped} of {total} prompts dropped at load, too long to generate "
            f"(a prompt needs fewer than {self.limit.tokens} tokens: {self.limit.source}; "
            f"the longest had {self.longest_dropped})"
        )


def drop_overlong_prompts(
    items: Sequence[PromptItem], count_tokens: Callable[[PromptItem], int], limit: TokenLimit
) -> PromptFilter:
    """The prompts that leave room for a generated token under `limit` (verl's overlong-prompt
    filter: a longer one would fail every sample of it at generation)."""
    kept: list[PromptItem] = []
    dropped, longest = 0, 0
    for item in items:
        n = count_tokens(item)
        if n < limit.tokens:
            kept.append(item)
        else:
            dropped, longest = dropped + 1, max(longest, n)
    return PromptFilter(kept=kept, dropped=dropped, longest_dropped=longest, limit=limit)
