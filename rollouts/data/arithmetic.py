"""The CPU demo's synthetic task: two-number addition in a short worked format.

A problem "47+38" is answered as "7+8=15 4+3+1=8 Answer: 85": the digits are added column by
column with the carry, then the final answer follows the "Answer:" marker that the verifier reads.
SFT teaches the format on worked conversations; RL with the exact-match verifier sharpens it.
Files are written as ordinary JSONL datasets, so the demo goes through the same loaders as any
user's data.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollouts.config import DataConfig
from rollouts.data.loaders import write_jsonl

ANSWER_MARKER = "Answer:"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One addition problem with its worked solution."""

    question: str
    answer: str
    worked: str


def worked_solution(a: int, b: int) -> str:
    """Column-by-column addition with carries, ending in 'Answer: <a+b>'."""
    assert a >= 0 and b >= 0, f"{a=} {b=} must be non-negative"
    steps = []
    carry = 0
    x, y = a, b
    while x or y or not steps:
        dx, dy = x % 10, y % 10
        total = dx + dy + carry
        steps.append(f"{dx}+{dy}+{carry}={total}" if steps else f"{dx}+{dy}={total}")
        carry = total // 10
        x, y = x // 10, y // 10
    return " ".join(steps) + f" {ANSWER_MARKER} {a + b}"


def make_problem(rng: random.Random, digits: int) -> Problem:
    """A random problem with two `digits`-digit operands."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Problem(question=f"{a}+{b}", answer=str(a + b), worked=worked_solution(a, b))


def make_problems(n: int, digits: int, seed: int, exclude: set[str] | None = None) -> list[Problem]:
    """`n` distinct problems (none of whose questions are in `exclude`), seeded."""
    assert n >= 1, f"{n=} must be >= 1"
    assert n <= (9 * 10 ** (digits - 1)) ** 2 // 2, f"{n=} too many for {digits=}"
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng, digits)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def write_demo_datasets(
    out_dir: str | Path,
    *,
    digits: int = 2,
    n_sft: int = 4000,
    n_rl: int = 4000,
    n_eval: int = 200,
    seed: int = 0,
    tool: bool = False,
    conversation: Callable[[Problem], dict[str, Any]] | None = None,
) -> dict[str, Path]:
    """Write sft.jsonl (worked conversations), train.jsonl (RL prompts) and eval.jsonl.

    The eval problems are disjoint from both training sets, so accuracy is held-out. With
    `tool`, the SFT conversations call the calculator tool instead of working the sum out;
    `conversation` writes each SFT conversation instead (another tool format).
    """
    out = Path(out_dir)
    evals = make_problems(n_eval, digits, seed + 1)
    held = {p.question for p in evals}
    sft = make_problems(n_sft, digits, seed + 2, exclude=held)
    rl = make_problems(n_rl, digits, seed + 3, exclude=held)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "train", "eval")}
    conversation = conversation or (_tool_conversation if tool else _conversation)
    write_jsonl(paths["sft"], [conversation(p) for p in sft])
    write_jsonl(paths["train"], [_prompt_row(p) for p in rl])
    write_jsonl(paths["eval"], [_prompt_row(p) for p in evals])
    return paths


def _conversation(p: Problem) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": p.worked},
        ]
    }


def _tool_conversation(p: Problem) -> dict[str, Any]:
    call = f"<calculator><expression>{p.question}</expression></calculator>"
    return {
        "messages": [
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": p.answer},
            {"role": "assistant", "content": f"{ANSWER_MARKER} {p.answer}"},
        ]
    }


def _prompt_row(p: Problem) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": p.question}], "label": p.answer}


def prepared_dir(data: DataConfig) -> Path:
    """The one directory of a `data.prepare` hook's DIR/sft.jsonl, train.jsonl and eval.jsonl."""
    paths = {"sft": data.sft_path, "train": data.train_path, "eval": data.eval_path}
    dirs = {str(Path(p).parent) for p in paths.values()}
    if len(dirs) != 1 or any(Path(p).name != f"{k}.jsonl" for k, p in paths.items()):
        raise ValueError(
            "data.prepare needs data.sft_path, data.train_path and data.eval_path as "
            f"DIR/sft.jsonl, DIR/train.jsonl, DIR/eval.jsonl; got {paths}"
        )
    return Path(dirs.pop())


def prepare_demo_data(
    data: DataConfig, conversation: Callable[[Problem], dict[str, Any]], digits: int = 2
) -> None:
    """A `data.prepare` hook's body: the demo datasets with SFT conversations written by
    `conversation`, where `data`'s paths point (DIR/sft, train, eval.jsonl), unless there."""
    out = prepared_dir(data)
    if not all((out / f"{k}.jsonl").is_file() for k in ("sft", "train", "eval")):
        write_demo_datasets(out, digits=digits, conversation=conversation)


def prepare_addition_tool_data(data: DataConfig) -> None:
    """`data.prepare` hook of the tools demo: 2-digit sums; SFT calls the calculator tool."""
    out = prepared_dir(data)
    if not all((out / f"{k}.jsonl").is_file() for k in ("sft", "train", "eval")):
        write_demo_datasets(out, digits=2, tool=True)


def final_answer_reward(sample: Any) -> float:
    """1.0 when the LAST assistant message says `Answer: <label>`, else 0.0 (no fallback).

    Strict on purpose for tool use: a number that only appears in a tool's output earns nothing.
    """
    messages = sample.metadata.get("messages")
    if messages:
        # an OpenAI-style assistant message that only calls tools has content None (the
        # gateway's records): no answer, so 0, never an error
        assistant = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
        text = assistant[-1] if assistant else ""
    elif "response_text" in sample.metadata:
        text = sample.metadata["response_text"]
    else:
        raise ValueError(f"sample {sample.index}: no messages or response_text to verify")
    if sample.label is None:
        raise ValueError(f"sample {sample.index}: no label to verify against")
    found = re.findall(rf"{ANSWER_MARKER}\s*(-?\d+)", text)
    return 1.0 if found and found[-1] == str(sample.label).strip() else 0.0


def prepare_addition_data(data: DataConfig) -> None:
    """`data.prepare` hook of the demo configs: write the datasets where the config points.

    The three paths must share one directory and be named sft/train/eval.jsonl; files that
    exist already are left as they are (so a resumed run reads the same data).
    """
    out = prepared_dir(data)
    if not all((out / f"{k}.jsonl").is_file() for k in ("sft", "train", "eval")):
        write_demo_datasets(out)
