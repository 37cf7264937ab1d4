"""The real-model recipe's task: held-out pairs stay out of training, mirrors included."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import DataConfig
from rollouts.data.chat_sums import all_pairs, prepare_sum_data, split_pairs
from rollouts.data.loaders import load_prompts


def test_split_holds_out_pairs_and_their_mirrors() -> None:
    pairs = all_pairs(30)
    train, held = split_pairs(pairs, 100, seed=0)
    assert len(held) == 100
    mirrors = {(b, a) for a, b in held} | set(held)
    assert not mirrors & set(train)
    assert set(train) | mirrors == set(pairs)
    assert split_pairs(pairs, 100, seed=0) == (train, held)  # seeded


def test_prepare_writes_chat_prompts_with_labels(tmp_path: Path) -> None:
    data = DataConfig(
        train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl")
    )
    prepare_sum_data(data)
    items = load_prompts(data.eval_path, "prompt", "label", "messages")
    assert len(items) == 100
    first = items[0]
    assert first.prompt[0]["role"] == "user"
    a, b = (
        int(x) for x in first.prompt[0]["content"].removeprefix("What is ").rstrip("?").split(" + ")
    )
    assert str(first.label) == str(a + b)
    with pytest.raises(ValueError, match="DIR/train.jsonl"):
        prepare_sum_data(DataConfig(train_path=str(tmp_path / "t.jsonl"), eval_path="e.jsonl"))
