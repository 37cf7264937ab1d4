"""Benchmark: the built-in engine's prefill with the shared prefix split off, against whole prompts.

In this process, two running batches of the engine (`engine/batch.py`) over the same
model, one with `share_prefix` (the prefix new prompts share prefilled once, and kept for the
next admission) and one without, serve the same multi-turn agent workload, rounds interleaved
(the first round warms up): the shop agent's prompts (`configs/smollm2-agent-cpu.toml`: the
tools' description in the system message) through SmolLM2's own template,
1. turn 0: `--groups` questions x `--samples` each, admitted together (a GRPO round);
2. turn 1: each of those conversations after a `lookup` call and its result, all distinct,
   admitted together;
3. turn 2: `--singles` conversations after the calculator's result, admitted one at a time (an
   episode's next turn arriving alone).
Greedy, `--new` tokens each (EOS ignored). Prints each phase's prefill and decode seconds
(medians over rounds), the ratio of the shared prefill's time to the whole prompts', and how
far the two agree: greedy tokens equal, and the largest difference of a sampled token's logprob.
The engine's numerics are the agent config's: fp32 weights under bf16 autocast, one thread.

    python scripts/bench_shared_prefix.py [--threads 1] [--rounds 4] [--groups 4] [--samples 8]
        [--singles 8] [--new 24] [--autocast bfloat16|off]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollouts.engine import precision  # noqa: E402
from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence  # noqa: E402
from rollouts.engine.sampling import SamplingSpec  # noqa: E402
from rollouts.envs import shop_data as shop  # noqa: E402
from rollouts.envs.shop import shop_tool_specs  # noqa: E402
from rollouts.envs.tool_format import call_text, render_with_tools  # noqa: E402
from rollouts.models.sources import fetch_source  # noqa: E402


def conversations(tokenizer, groups: int, samples: int) -> tuple[list, list, list]:
    """Token ids of turn 0 (groups x samples), turn 1 and turn 2 (one per turn-0 prompt)."""
    catalogue = shop.make_catalogue(0)
    qs = shop.questions(list(shop.item_names())[: groups * 2], catalogue)[:: 18 // 2][:groups]
    tools = shop_tool_specs()

    def ids(messages: list[dict]) -> list[int]:
        text = render_with_tools(tokenizer, messages, tools, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    turn0, turn1, turn2 = [], [], []
    for q in qs:
        item, (a, b) = q["item"], q["expr"]
        base = [
            {"role": "system", "content": shop.INSTRUCTIONS},
            {"role": "user", "content": q["question"]},
        ]
        for s in range(samples):
            turn0.append(ids(base))
            facts = json.dumps({"item": item, **catalogue[item], "n": s})  # each one distinct
            one = [
                *base,
                {"role": "assistant", "content": call_text("lookup", {"item": item})},
                {"role": "tool", "content": facts},
            ]
            turn1.append(ids(one))
            two = [
                *one,
                {
                    "role": "assistant",
                    "content": call_text("calculator", {"expression": f"{a}*{b}"}),
                },
                {"role": "tool", "content": str(a * b + s)},
            ]
            turn2.append(ids(two))
    return turn0, turn1, turn2


def serve(
    batch: RunningBatch, admissions: list[list[list[int]]], new: int
) -> tuple[float, float, list]:
    """(prefill s, decode s, finished sequences in order) of the admissions, each run to the end."""
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    prefill_s = decode_s = 0.0
    done = []
    with torch.inference_mode():
        for prompts in admissions:
            seqs = [
                Sequence(rid=str(i), prompt_ids=p, spec=spec, max_new=new, notify=lambda s: None)
                for i, p in enumerate(prompts)
            ]
            start = time.perf_counter()
            finished = batch.admit(seqs)[1]
            prefill_s += time.perf_counter() - start
            start = time.perf_counter()
            while len(batch):
                finished += batch.step()
            decode_s += time.perf_counter() - start
            by_rid = {s.rid: s for s in finished}
            done += [by_rid[str(i)] for i in range(len(prompts))]
    return prefill_s, decode_s, done


def options(tokenizer, share: bool) -> BatchOptions:
    """The engine's batch options here: room for every row, greedy's defaults."""
    return BatchOptions(
        max_batch=128,
        max_prefill=64,
        pad_token_id=tokenizer.pad_token_id or 0,
        eos_token_ids=(),
        logprobs_from="raw",
        share_prefix=share,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--singles", type=int, default=8)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--autocast", default="bfloat16", choices=("bfloat16", "off"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch_source("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    precision.mix(model, args.autocast)
    turn0, turn1, turn2 = conversations(tokenizer, args.groups, args.samples)
    phases = {
        "turn 0 (groups together)": [turn0],
        "turn 1 (distinct, together)": [turn1],
        "turn 2 (one at a time)": [[p] for p in turn2[: args.singles]],
    }
    tokens = {name: sum(len(p) for a in adm for p in a) for name, adm in phases.items()}
    print(
        f"SmolLM2-135M, autocast {args.autocast}, {args.threads} thread(s); prompt tokens: "
        + ", ".join(f"{n}: {t}" for n, t in tokens.items())
    )
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    outputs: dict[bool, dict[str, list]] = {}
    for r in range(args.rounds + 1):
        for share in (r % 2 == 0, r % 2 != 0):
            for name, admissions in phases.items():
                batch = RunningBatch(model, tokenizer, options(tokenizer, share))
                pre, dec, done = serve(batch, admissions, args.new)
                if r:  # round 0 warms up
                    times.setdefault((name, share), []).append((pre, dec))
                outputs.setdefault(share, {})[name] = done
    print(f"{'phase':30} {'whole prefill':>14} {'shared prefill':>15} {'ratio':>6} {'decode':>8}")
    total = {True: 0.0, False: 0.0}
    for name in phases:
        whole = statistics.median(p for p, _ in times[(name, False)])
        shared = statistics.median(p for p, _ in times[(name, True)])
        dec = statistics.median(d for _, d in times[(name, True)] + times[(name, False)])
        total[False] += whole + dec
        total[True] += shared + dec
        print(f"{name:30} {whole:13.2f}s {shared:14.2f}s {shared / whole:6.2f} {dec:7.2f}s")
    print(
        f"prefill + decode of the workload: {total[True]:.2f} s shared against {total[False]:.2f} s"
        f" whole: {total[True] / total[False]:.2f}x"
    )
    shared = [s for name in phases for s in outputs[True][name]]
    whole = [s for name in phases for s in outputs[False][name]]
    print("shared against whole:", agreement(shared, whole))
    # the noise floor: whole prompts again, turn 1 admitted in two halves (other padding, other
    # matmul shapes), against all together
    half = len(turn1) // 2
    batch = RunningBatch(model, tokenizer, options(tokenizer, share=False))
    halves = serve(batch, [turn1[:half], turn1[half:]], args.new)
    print(
        "the same engine, whole prompts, turn 1 in two halves against together:",
        agreement(halves[2], outputs[False]["turn 1 (distinct, together)"]),
    )


def agreement(a: list, b: list) -> str:
    """Greedy outputs equal, and the largest sampled-token logprob difference where equal."""
    equal = [(x, y) for x, y in zip(a, b, strict=True) if x.output_ids == y.output_ids]
    worst = max(
        (abs(u - v) for x, y in equal for u, v in zip(x.logprobs, y.logprobs, strict=True)),
        default=0.0,
    )
    return f"greedy outputs equal {len(equal)} of {len(a)}, logprobs within {worst:.2e}"


if __name__ == "__main__":
    main()
