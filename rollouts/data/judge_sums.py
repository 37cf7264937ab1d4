"""A judge's task that exact match cannot grade: answers to "What is a + b?" in free form (a
numeral, words such as "forty-two", a sentence), right or wrong, graded by an LLM judge
([judge], `rollout.reward_fn = "judge"`) against the reference sum.

`prepare_judge_data` (a `data.prepare` hook) writes DIR/sft.jsonl: judge conversations on the
training pairs of `chat_sums` (the question, its reference, an answer; the judge's reply
"Score: 10" or "Score: 0"), half of them right, so that a small model can be taught to judge.
The held-out pairs of `chat_sums` are never in it: `graded_answers` draws the measurement's
answers from them (`scripts/judge_agreement.py`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollouts.config import DataConfig
from rollouts.config.served import DEFAULT_JUDGE_TEMPLATE
from rollouts.data.chat_sums import QUESTION, all_pairs, split_pairs
from rollouts.data.loaders import write_jsonl

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
ONES = _ONES.split()
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
RIGHT, WRONG = "Score: 10", "Score: 0"


def in_words(n: int) -> str:
    """0..99 in English words: 42 -> "forty-two"."""
    assert 0 <= n < 100, f"{n=}"
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] + ("" if ones == 0 else f"-{ONES[ones]}")


def phrasings(a: int, b: int) -> list[Callable[[int], str]]:
    """The ways an answer to a + b is written here."""
    return [
        str,
        in_words,
        lambda n: f"The sum is {n}.",
        lambda n: f"{a} + {b} = {n}",
        lambda n: f"It is {in_words(n)}.",
        lambda n: in_words(n).capitalize() + ".",
    ]


def answers(a: int, b: int, rng: random.Random) -> list[tuple[str, bool]]:
    """One right and one wrong answer to a + b (off by 1 to 10), each phrased by `rng`."""
    right = a + b
    wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
    if wrong < 0 or wrong >= 100:
        wrong = right - rng.randint(1, 10) if right >= 11 else right + rng.randint(1, 10)
    forms = phrasings(a, b)
    return [(rng.choice(forms)(right), True), (rng.choice(forms)(wrong), False)]


def judge_question(a: int, b: int, response: str, template: str = DEFAULT_JUDGE_TEMPLATE) -> str:
    """What the judge is asked about `response` (the judge reward's own filling)."""
    return template.format(question=QUESTION.format(a=a, b=b), reference=a + b, response=response)


def judge_rows(pairs: list[tuple[int, int]], seed: int) -> list[dict[str, Any]]:
    """Judge conversations: for each pair a right and a wrong answer, and the verdict."""
    rng = random.Random(seed)
    rows = []
    for a, b in pairs:
        for text, right in answers(a, b, rng):
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": judge_question(a, b, text)},
                        {"role": "assistant", "content": RIGHT if right else WRONG},
                    ]
                }
            )
    return rows


def graded_answers(n: int, seed: int) -> list[tuple[int, int, str, bool]]:
    """(a, b, answer, right) on `n` held-out pairs of `chat_sums` (none in the judge's SFT)."""
    _, held = split_pairs(all_pairs(30), 100, 0)
    rng = random.Random(seed)
    out = []
    for a, b in rng.sample(held, min(n, len(held))):
        out += [(a, b, text, right) for text, right in answers(a, b, rng)]
    return out


WORDS_QUESTION = "What is {a} + {b}? Write the answer in words."


def words_row(a: int, b: int) -> dict[str, Any]:
    """A policy prompt whose answer exact match cannot grade ("forty-two"); label: the sum."""
    return {
        "messages": [{"role": "user", "content": WORDS_QUESTION.format(a=a, b=b)}],
        "label": a + b,
    }


def prepare_judge_data(data: DataConfig) -> None:
    """`data.prepare` hook. With `data.sft_path` = DIR/sft.jsonl: the judge's SFT
    conversations; with `data.train_path` and `data.eval_path`: the policy's prompts asking
    for the sum in words (the held-out pairs of `chat_sums`). Files that exist are kept."""
    train, held = split_pairs(all_pairs(30), 100, 0)
    if data.sft_path:
        sft = Path(data.sft_path)
        if sft.name != "sft.jsonl":
            raise ValueError(
                f"data.prepare = prepare_judge_data needs data.sft_path = DIR/sft.jsonl; got "
                f"{data.sft_path!r}"
            )
        if not sft.is_file():
            write_jsonl(sft, judge_rows(train, seed=1))
    for path, pairs in ((data.train_path, train), (data.eval_path, held)):
        if path and not Path(path).is_file():
            write_jsonl(Path(path), [words_row(a, b) for a, b in pairs])
