"""GSM8K-shaped word problems, written as parquet with GSM8K's own columns: the CPU twin of
configs/gpu-gsm8k.toml (configs/smollm2-gsm8k-cpu.toml) reads them the way it would read GSM8K.

Each row has `question` ("Mia has 12 shells. She finds 7 more. How many shells does Mia have
now?") and `answer`, a worked solution with GSM8K's calculator annotation and its final line
("Mia has 12 + 7 = <<12+7=19>>19 shells.\\n#### 19"); the math reward grades against the text
after `####`. One step each (an addition, a subtraction or a product), small numbers: a
135M model solves some before training, so RL has a signal. The held-out problems share no
(kind, numbers) with the training ones.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from rollouts.config import DataConfig

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Lily", "Ben", "Nora", "Eli")
THINGS = ("apples", "shells", "stickers", "marbles", "books", "pencils", "cookies", "stamps")
PRONOUN = {n: ("She" if n in ("Mia", "Ava", "Zoe", "Ivy", "Lily", "Nora") else "He") for n in NAMES}

ProblemKind = Literal["add", "sub", "mul"]
# kind -> (question, worked answer); {c} is the result
TEMPLATES: dict[ProblemKind, tuple[str, str]] = {
    "add": (
        "{n} has {a} {t}. {p} gets {b} more {t}. How many {t} does {n} have now?",
        "{n} has {a} + {b} = <<{a}+{b}={c}>>{c} {t} now.",
    ),
    "sub": (
        "{n} had {a} {t}. {p} gave {b} of them to a friend. How many {t} does {n} have left?",
        "{n} has {a} - {b} = <<{a}-{b}={c}>>{c} {t} left.",
    ),
    "mul": (
        "{n} buys {a} bags of {t}. Each bag holds {b} {t}. How many {t} does {n} buy?",
        "{n} buys {a} * {b} = <<{a}*{b}={c}>>{c} {t}.",
    ),
}


def problems() -> list[tuple[ProblemKind, int, int]]:
    """Every (kind, a, b): sums of 2..30, differences with a > b, products of 2..9."""
    out: list[tuple[ProblemKind, int, int]]
    out = [("add", a, b) for a in range(2, 31) for b in range(2, 31)]
    out += [("sub", a, b) for a in range(3, 31) for b in range(2, a)]
    out += [("mul", a, b) for a in range(2, 10) for b in range(2, 10)]
    return out


def result(kind: ProblemKind, a: int, b: int) -> int:
    assert kind in TEMPLATES, f"{kind=} is not one of {list(TEMPLATES)}"
    return {"add": a + b, "sub": a - b, "mul": a * b}[kind]


def row(kind: ProblemKind, a: int, b: int, rng: random.Random) -> dict[str, Any]:
    """One GSM8K-format row: `question`, and `answer` ending in `#### <result>`."""
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    fields = {"n": name, "p": PRONOUN[name], "t": things, "a": a, "b": b, "c": result(kind, a, b)}
    question, worked = TEMPLATES[kind]
    return {
        "question": question.format(**fields),
        "answer": f"{worked.format(**fields)}\n#### {fields['c']}",
    }


def write_word_problems(
    out_dir: str | Path, *, n_test: int = 200, seed: int = 0
) -> dict[str, Path]:
    """DIR/train.parquet and DIR/test.parquet (`n_test` held-out problems), GSM8K's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    order = problems()
    rng.shuffle(order)
    held, train = order[:n_test], order[n_test:]
    assert not set(held) & set(train), "a held-out problem leaked into training"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet"}
    for split, chosen in (("train", train), ("test", held)):
        rows = [row(kind, a, b, rng) for kind, a, b in chosen]
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def prepare_word_problems(data: DataConfig) -> None:
    """`data.prepare` hook of configs/smollm2-gsm8k-cpu.toml: DIR/train.parquet and
    DIR/test.parquet where data.train_path and data.eval_path point; files that exist already
    are left as they are (a resumed run reads the same data)."""
    train, test = Path(data.train_path), Path(data.eval_path)
    if train.name != "train.parquet" or test != train.with_name("test.parquet"):
        raise ValueError(
            "data.prepare = prepare_word_problems needs data.train_path = DIR/train.parquet and "
            f"data.eval_path = DIR/test.parquet; got {data.train_path!r}, {data.eval_path!r}"
        )
    if not (train.is_file() and test.is_file()):
        write_word_problems(train.parent)
