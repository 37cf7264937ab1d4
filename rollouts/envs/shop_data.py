"""The shop task's data: a seeded catalogue, questions only its tools answer, SFT traces.

A catalogue of items, each with a 2-digit price and stock drawn from the seed. Two kinds of
question: "What do Q units of ITEM cost?" (Q * price) and "What is the value of the ITEM stock?"
(price * stock). The items are split three ways: the SFT traces ask about some, the RL prompts
about others (items SFT never showed), and the held-out questions about the rest, so no eval
question (nor its item's facts) is seen in training. SFT traces are whole conversations in the
one tool format (`envs/tool_format`): the tools described in the system message (SmolLM2's
template ignores `tools`), a `lookup` call, its result as a `tool` message, a `calculator` call,
its result, then "Answer: N". Every prompt row carries the catalogue, which the environment
(`envs/shop.shop_env`) reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rollouts.config import DataConfig
from rollouts.data.arithmetic import prepared_dir
from rollouts.data.loaders import write_jsonl
from rollouts.envs.shop import ANSWER_MARKER, CATALOGUE_KEY, shop_tool_specs
from rollouts.envs.tool_format import call_text, tool_system_text

_ITEM_WORDS = (
    "anchor apron basket beaker blanket bottle bucket button candle carpet chisel clock "
    "compass cushion drill easel flask funnel glove hammer helmet jacket kettle ladder lantern "
    "magnet mirror mitten napkin needle notebook padlock pencil pillow plate pliers pouch "
    "quilt radio ribbon ruler saddle scarf shovel sponge spoon stapler teapot thimble towel "
    "trowel tulip umbrella vase wallet whistle wrench yarn zipper"
)


def item_names() -> tuple[str, ...]:
    """The shop's 59 items (one word each)."""
    return tuple(_ITEM_WORDS.split())


INSTRUCTIONS = "Answer questions about a shop with its tools. End with 'Answer: <number>'."
COST, VALUE = "What do {q} units of {item} cost?", "What is the value of the {item} stock?"


QUANTITIES = range(2, 10)


def make_catalogue(seed: int) -> dict[str, dict[str, int]]:
    """Every item with a price and a stock in 11..99, drawn from `seed`."""
    rng = random.Random(seed)
    return {
        item: {"price": rng.randint(11, 99), "stock": rng.randint(11, 99)} for item in item_names()
    }


def questions(items: list[str], catalogue: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Every question about `items`: the cost of 2..9 units, and the stock's value.

    One-digit quantities: with 3..19 (ten of seventeen starting with "1") a model that had not
    learnt to copy the quantity wrote "1" first whatever the question said, right for 10..19
    and wrong for the rest, and RL, whose groups of 3..9 all failed, only reinforced it. Each of
    2..9 is as likely a guess as the others, so a group where it is guessed differs."""
    out = []
    for item in items:
        price, stock = catalogue[item]["price"], catalogue[item]["stock"]
        for q in QUANTITIES:
            out.append({"item": item, "question": COST.format(q=q, item=item), "expr": (q, price)})
        out.append({"item": item, "question": VALUE.format(item=item), "expr": (price, stock)})
    return out


def _prompt_row(q: dict[str, Any], catalogue: dict[str, dict[str, int]]) -> dict[str, Any]:
    a, b = q["expr"]
    return {
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": q["question"]},
        ],
        "label": str(a * b),
        "item": q["item"],
        CATALOGUE_KEY: catalogue,
    }


def trace(q: dict[str, Any], catalogue: dict[str, dict[str, int]]) -> dict[str, Any]:
    """One SFT conversation: lookup, calculator, answer, with the tools in the system message."""
    item, (a, b) = q["item"], q["expr"]
    facts = json.dumps({"item": item, **catalogue[item]})
    # what envs/tool_format.with_tools makes of the prompt's system message for SmolLM2
    system = f"{INSTRUCTIONS}\n\n{tool_system_text(shop_tool_specs())}"
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": q["question"]},
            {"role": "assistant", "content": call_text("lookup", {"item": item})},
            {"role": "tool", "content": facts},
            {"role": "assistant", "content": call_text("calculator", {"expression": f"{a} * {b}"})},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"{ANSWER_MARKER} {a * b}"},
        ]
    }


def write_shop_datasets(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_eval_items: int = 15,
    n_sft_items: int = 22,
    n_sft: int | None = None,
) -> dict[str, Path]:
    """sft.jsonl (traces), train.jsonl (prompts) and eval.jsonl (held-out items' prompts).

    The items are split three ways: `n_eval_items` held out for evaluation, `n_sft_items` whose
    questions make the SFT traces, and the rest, whose questions are the RL prompts. RL thus
    asks about items SFT never showed (where the SFT model misspells a name it has not seen,
    RL has something to correct), and the evaluation about items neither phase saw."""
    catalogue = make_catalogue(seed)
    rng = random.Random(seed + 1)
    items = list(item_names())
    rng.shuffle(items)
    held, sft_items = items[:n_eval_items], items[n_eval_items : n_eval_items + n_sft_items]
    rl_items = items[n_eval_items + n_sft_items :]
    assert rl_items, f"{n_eval_items=} + {n_sft_items=} leave no item of {len(items)} for RL"
    sft_qs, train, evals = (questions(x, catalogue) for x in (sft_items, rl_items, held))
    for qs in (sft_qs, train, evals):
        rng.shuffle(qs)
    assert not {q["item"] for q in sft_qs + train} & set(held), "eval leaked"
    n_sft = len(sft_qs) if n_sft is None else n_sft
    assert n_sft <= len(sft_qs), f"{n_sft=} > {len(sft_qs)=} questions of the SFT items"
    out = Path(out_dir)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "train", "eval")}
    write_jsonl(paths["sft"], [trace(q, catalogue) for q in sft_qs[:n_sft]])
    write_jsonl(paths["train"], [_prompt_row(q, catalogue) for q in train])
    write_jsonl(paths["eval"], [_prompt_row(q, catalogue) for q in evals])
    return paths


# the config's data: catalogue seed, items held out and SFT's; quantities 2..9 (`questions`)
SPLIT = {"seed": 0, "n_eval_items": 15, "n_sft_items": 22, "quantities": "2..9"}
SPLIT_FILE = "split.json"


def prepare_shop_data(data: DataConfig) -> None:
    """`data.prepare` hook of configs/smollm2-agent-cpu.toml (catalogue seed 0, `SPLIT`).

    The three paths must be DIR/sft.jsonl, DIR/train.jsonl, DIR/eval.jsonl; files that exist
    already are left as they are (a resumed run reads the same data), unless DIR/split.json
    says they were written with another split: that is an error naming DIR (never a run on
    data it did not ask for).
    """
    out = prepared_dir(data)
    if all((out / f"{k}.jsonl").is_file() for k in ("sft", "train", "eval")):
        marker = out / SPLIT_FILE
        found = json.loads(marker.read_text()) if marker.is_file() else None
        if found != SPLIT:
            raise ValueError(
                f"{out}: its shop data was written with another split ({marker.name}: "
                f"{found}; this version writes {SPLIT}); remove {out} and it is written again"
            )
        return
    write_shop_datasets(out, **{k: v for k, v in SPLIT.items() if k != "quantities"})
    (out / SPLIT_FILE).write_text(json.dumps(SPLIT) + "\n")
