"""The real-model recipe's task: small sums asked as chat messages, answered in a few tokens.

"What is 17 + 25?" goes to the model through its own chat template (the template adds its
default system prompt); the exact-match verifier reads the final number of the reply. The eval
problems are held out: neither (a, b) nor (b, a) of an eval problem is in the training prompts.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rollouts.config import DataConfig
from rollouts.data.loaders import write_jsonl

QUESTION = "What is {a} + {b}?"


def all_pairs(max_operand: int) -> list[tuple[int, int]]:
    """Every (a, b) with 1 <= a, b <= max_operand."""
    assert max_operand >= 2, f"{max_operand=} must be >= 2"
    return [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]


def split_pairs(
    pairs: list[tuple[int, int]], n_eval: int, seed: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, eval): `n_eval` pairs held out together with their mirror images."""
    assert 0 < n_eval < len(pairs) // 2, f"{n_eval=} for {len(pairs)=} pairs"
    order = list(pairs)
    random.Random(seed).shuffle(order)
    held: list[tuple[int, int]] = []
    blocked: set[tuple[int, int]] = set()
    for a, b in order:
        if len(held) == n_eval:
            break
        if (a, b) not in blocked:
            held.append((a, b))
            blocked |= {(a, b), (b, a)}
    train = [p for p in order if p not in blocked]
    assert not set(train) & blocked, "an eval pair leaked into training"
    return train, held


def prompt_row(a: int, b: int) -> dict[str, Any]:
    """One prompt line: a single user message (no system prompt: the template adds its own)."""
    return {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "label": a + b}


def write_sum_datasets(
    out_dir: str | Path, *, max_operand: int = 30, n_eval: int = 100, seed: int = 0
) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl (held-out pairs) of `a + b` chat prompts."""
    train, held = split_pairs(all_pairs(max_operand), n_eval, seed)
    out = Path(out_dir)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    write_jsonl(paths["train"], [prompt_row(a, b) for a, b in train])
    write_jsonl(paths["eval"], [prompt_row(a, b) for a, b in held])
    return paths


def prepare_sum_data(data: DataConfig) -> None:
    """`data.prepare` hook of configs/smollm2-cpu.toml: DIR/train.jsonl and DIR/eval.jsonl.

    Files that exist already are left as they are (a resumed run reads the same data).
    """
    train, evals = Path(data.train_path), Path(data.eval_path)
    if train.name != "train.jsonl" or evals != train.with_name("eval.jsonl"):
        raise ValueError(
            "data.prepare = prepare_sum_data needs data.train_path = DIR/train.jsonl and "
            f"data.eval_path = DIR/eval.jsonl; got {data.train_path!r}, {data.eval_path!r}"
        )
    if not (train.is_file() and evals.is_file()):
        write_sum_datasets(train.parent)
