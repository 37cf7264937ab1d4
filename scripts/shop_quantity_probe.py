"""Does a shop-agent checkpoint read the quantity? p(the right digit) where it writes it.

For cost questions ("What do Q units of ITEM cost?") after a correct lookup, the probability the
model gives the quantity's digit as the first token of its calculator expression, averaged over
items of each part of the split (SFT's, RL's, held out) and Q in 3, 6, 8. Chance is about 1/8;
a model that reads the quantity is near 1. configs/smollm2-agent-cpu.toml's figures use it:

    python scripts/shop_quantity_probe.py runs/X/checkpoints/sft/step_000009/model \
        [--data runs/smollm2-shop-data] [--items 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.envs.shop_data import item_names
from rollouts.envs.tool_format import CALL_OPEN


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an HF model directory (a merged SFT checkpoint)")
    ap.add_argument("--data", type=Path, default=Path("runs/smollm2-shop-data"))
    ap.add_argument("--items", type=int, default=4, help="items of each part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sft, train, evals = (_rows(args.data / f"{k}.jsonl") for k in ("sft", "train", "eval"))
    system, catalogue = sft[0]["messages"][0], evals[0]["catalogue"]
    names = item_names()
    sft_items = sorted({w for r in sft for w in names if f" {w} " in r["messages"][1]["content"]})
    parts = {
        "sft items": sft_items,
        "rl items": sorted({r["item"] for r in train}),
        "held-out items": sorted({r["item"] for r in evals}),
    }
    lookup = CALL_OPEN + '{"name": "lookup", "arguments": {"item": "%s"}}</tool_call>'
    calc = CALL_OPEN + '{"name": "calculator", "arguments": {"expression": "'
    for part, items in parts.items():
        probs = []
        for item in items[: args.items]:
            facts = {"item": item, **catalogue[item]}
            for q in (3, 6, 8):
                messages = [
                    system,
                    {"role": "user", "content": f"What do {q} units of {item} cost?"},
                    {"role": "assistant", "content": lookup % item},
                    {"role": "tool", "content": json.dumps(facts)},
                ]
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = tok(text + calc, return_tensors="pt").input_ids
                with torch.no_grad():
                    p = model(ids).logits[0, -1].softmax(-1)
                probs.append(float(p[tok.convert_tokens_to_ids(str(q))]))
        mean = sum(probs) / len(probs)
        print(f"{part}: p(right digit) {mean:.3f}  [{', '.join(f'{x:.2f}' for x in probs)}]")


if __name__ == "__main__":
    main()
