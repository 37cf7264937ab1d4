"""The judge's task data: free-form answers (numerals, words, sentences), half right, and the
held-out pairs kept out of the judge's SFT conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollouts.config import DataConfig
from rollouts.data.chat_sums import all_pairs, split_pairs
from rollouts.data.judge_sums import (
    RIGHT,
    WRONG,
    answers,
    graded_answers,
    in_words,
    prepare_judge_data,
)


@pytest.mark.parametrize(
    ("n", "words"),
    [(0, "zero"), (13, "thirteen"), (40, "forty"), (42, "forty-two"), (99, "ninety-nine")],
)
def test_numbers_in_words(n: int, words: str) -> None:
    assert in_words(n) == words


def test_each_pair_gets_a_right_and_a_wrong_answer() -> None:
    rng = random.Random(0)
    for a, b in [(1, 1), (17, 25), (30, 30)]:
        (right, r_ok), (wrong, w_ok) = answers(a, b, rng)
        assert r_ok and not w_ok and right != wrong


def test_the_judges_sft_data_holds_no_held_out_pair(tmp_path: Path) -> None:
    data = DataConfig(
        sft_path=str(tmp_path / "sft.jsonl"),
        train_path=str(tmp_path / "train.jsonl"),
        eval_path=str(tmp_path / "eval.jsonl"),
    )
    prepare_judge_data(data)
    rows = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    verdicts = [r["messages"][1]["content"] for r in rows]
    assert verdicts.count(RIGHT) == verdicts.count(WRONG) == len(rows) // 2
    _, held = split_pairs(all_pairs(30), 100, 0)
    asked = {r["messages"][0]["content"].split("Question: What is ")[1].split("?")[0] for r in rows}
    assert not asked & {f"{a} + {b}" for a, b in held}
    measured = {(a, b) for a, b, _, _ in graded_answers(40, 0)}
    assert measured <= set(held)
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == len(held) and evals[0]["messages"][0]["content"].endswith("in words.")
