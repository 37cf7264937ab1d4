"""The shop task's data: a seeded catalogue, questions only its tools answer, SFT traces.

A catalogue of items, each with a 2-digit price and stock drawn from the seed. Two kinds of
question: "What do Q units of ITEM cost?" (Q * price) and "What is the value of the ITEM stock?"
(price * stock). The held-out questions ask about held-out items, so no eval question (nor its
item's facts) is seen in training. SFT traces are whole conversations in the one tool format
(`envs/tool_format`): the tools described in the system message (SmolLM2's template ignores
`tools`), a `lookup` call, its result as a `tool` message, a `calculator` call, its result,
then "Answer: N". Every prompt row carries the catalogue, which the environment
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


def make_catalogue(seed: int) -> dict[str, dict[str, int]]:
    """Every item with a price and a stock in 11..99, drawn from `seed`."""
    rng = random.Random(seed)
    return {
        item: {"price": rng.randint(11, 99), "stock": rng.randint(11, 99)} for item in item_names()
    }


def questions(items: list[str], catalogue: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Every question about `items`: the cost of 3..19 units, and the stock's value."""
    out = []
    for item in items:
        price, stock = catalogue[item]["price"], catalogue[item]["stock"]
        for q in range(3, 20):
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
    out_dir: str | Path, *, seed: int = 0, n_eval_items: int = 15, n_sft: int = 300
) -> dict[str, Path]:
    """sft.jsonl (traces), train.jsonl (prompts) and eval.jsonl (held-out items' prompts)."""
    catalogue = make_catalogue(seed)
    rng = random.Random(seed + 1)
    items = list(item_names())
    rng.shuffle(items)
    held, kept = items[:n_eval_items], items[n_eval_items:]
    train, evals = questions(kept, catalogue), questions(held, catalogue)
    rng.shuffle(train)
    rng.shuffle(evals)
    assert not {q["question"] for q in train} & {q["question"] for q in evals}, "eval leaked"
    assert n_sft <= len(train), f"{n_sft=} > {len(train)=} training questions"
    out = Path(out_dir)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "train", "eval")}
    write_jsonl(paths["sft"], [trace(q, catalogue) for q in train[:n_sft]])
    write_jsonl(paths["train"], [_prompt_row(q, catalogue) for q in train])
    write_jsonl(paths["eval"], [_prompt_row(q, catalogue) for q in evals])
    return paths


def prepare_shop_data(data: DataConfig) -> None:
    """`data.prepare` hook of configs/smollm2-agent-cpu.toml (catalogue seed 0).

    The three paths must be DIR/sft.jsonl, DIR/train.jsonl, DIR/eval.jsonl; files that exist
    already are left as they are (a resumed run reads the same data).
    """
    out = prepared_dir(data)
    if not all((out / f"{k}.jsonl").is_file() for k in ("sft", "train", "eval")):
        write_shop_datasets(out)
