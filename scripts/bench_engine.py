"""Benchmark: the built-in engine server vs in-process padded `model.generate`, same process.

The RL-shaped workload of issue 11: 16 prompts x 8 samples = 128 sequences, temperature 1,
top-k/top-p off, EOS ignored so lengths are exact, the logprob of every sampled token returned.
Two cases: every sequence 64 new tokens ("equal"), and each sequence its own length, uniform in
4..64 ("varying"). The baseline is what TRL does: one left-padded `generate` call over the 128
rows (each prompt repeated 8 times), run to the longest length, with the logprobs gathered from
its logits; only the requested tokens count. The server gets the 128 sequences as 128 concurrent
requests (as the rollout manager sends them) through the SGLang and the vLLM client.
Both sides use the same number of torch threads (`--threads`, default 1, as issue 11 measured).

    .venv/bin/python scripts/bench_engine.py [--reps 2] [--hidden 128] [--layers 3]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio
from transformers import AutoModelForCausalLM

from rollouts.inference.http import HttpOptions
from rollouts.inference.launch import engine_process
from rollouts.inference.protocol import SamplingParams
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

GOALS = {"equal": 1.0, "varying": 1.5}


def workload(
    prompts: int, group: int, seed: int, equal: int | None
) -> tuple[list[list[int]], list[int]]:
    """`prompts` prompts of 16-48 byte tokens, each repeated `group` times, and output lengths
    (all `equal`, or uniform in 4..64 per sequence)."""
    rng = random.Random(seed)
    base = [[rng.randrange(3, 259) for _ in range(rng.randint(16, 48))] for _ in range(prompts)]
    seqs = [p for p in base for _ in range(group)]
    lengths = [equal if equal is not None else rng.randint(4, 64) for _ in seqs]
    return seqs, lengths


@torch.inference_mode()
def baseline(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> float:
    """Seconds of one left-padded sampling `generate` call over all rows, logprobs included."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(lengths)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits_B_T_V = torch.stack(out.logits, dim=1).float()
    new_B_T = out.sequences[:, width:]
    logprobs_B_T = logits_B_T_V.log_softmax(-1).gather(2, new_B_T.unsqueeze(2)).squeeze(2)
    assert logprobs_B_T.shape == (len(prompts), longest), f"{logprobs_B_T.shape=}"
    return time.perf_counter() - start


async def through(client, prompts: list[list[int]], lengths: list[int]) -> float:
    """Seconds for all requests sent at once through `client` (logprobs come back)."""
    done: list[int] = []

    async def one(p: list[int], n: int) -> None:
        sampling = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        c = await client.generate(p, sampling)
        assert len(c.logprobs) == n, f"{len(c.logprobs)=} != {n=}"
        done.append(c.completion_tokens)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for p, n in zip(prompts, lengths, strict=True):
            nursery.start_soon(one, p, n)
    elapsed = time.perf_counter() - start
    assert sum(done) == sum(lengths), f"{sum(done)=} != {sum(lengths)=}"
    return elapsed


def cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drained(log_path: str) -> list[tuple[float, ...]]:
    """(busy s, decode steps, ms/step, prefills) of each "batch drained" line in the server log."""
    found = re.findall(
        r"after ([\d.]+) s: (\d+) decode steps, ([\d.]+) ms/step.*?; (\d+) prefills",
        Path(log_path).read_text(),
    )
    return [tuple(float(x) for x in line) for line in found]


async def run_all(model, model_dir: str, cases: dict, args: argparse.Namespace) -> dict:
    """{(case, side): [(wall s, cpu s) per rep]}; each rep times the baseline and both clients
    back to back, so a ratio compares runs under the same load of the machine."""
    options = HttpOptions(max_connections=args.connections, timeout_s=600)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    async with engine_process(
        model_dir,
        max_batch=args.max_batch,
        torch_threads=args.threads,
        startup_timeout_s=300,
        extra_args=("--log-level", "DEBUG"),  # the core logs its ms/step when a batch drains
    ) as proc:
        pid = proc.process.pid
        clients = {"SGLang": SGLangEngine(proc.url, options=options)}
        clients["vLLM"] = VLLMEngine(proc.url, options=options)
        for client in clients.values():  # warm-up
            await through(client, *[x[: args.group] for x in cases["varying"]])
        baseline(model, *cases["equal"], 0)
        for _ in range(args.reps):
            for name, (prompts, lengths) in cases.items():
                cpu0 = time.process_time()
                wall = baseline(model, prompts, lengths, 0)
                out.setdefault((name, "generate"), []).append((wall, time.process_time() - cpu0))
                for side, client in clients.items():
                    cpu0, seen = cpu_s(pid), len(drained(proc.log_path))
                    wall = await through(client, prompts, lengths)
                    out.setdefault((name, side), []).append((wall, cpu_s(pid) - cpu0))
                    out.setdefault((name, side + " steps"), []).extend(
                        drained(proc.log_path)[seen:]
                    )
        for client in clients.values():
            await client.aclose()
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--equal-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each case (median)")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = tempfile.mkdtemp(prefix="bench-engine-")
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=256,
        seed=args.seed,
    )
    make_tiny_model(model_dir, spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    cases = {
        "equal": workload(args.prompts, args.group, args.seed, args.equal_len),
        "varying": workload(args.prompts, args.group, args.seed + 1, None),
    }
    timed = trio.run(run_all, model, model_dir, cases, args)
    rows = args.prompts * args.group
    print(
        f"{rows} sequences ({args.prompts} prompts x {args.group}), temperature 1, logprobs; "
        f"tiny Llama hidden {args.hidden}, {args.layers} layers; torch threads {args.threads} "
        f"per side (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
        f"{args.reps} reps, medians (ratios per rep, then median)"
    )
    print(
        f"{'case':<8} {'tokens':>6} {'generate tok/s':>14} {'ms/step':>7} {'SGLang tok/s':>12} "
        f"{'ms/step':>7} {'ratio':>5} {'vLLM tok/s':>10} {'ratio':>5} {'cpu ratio S/V':>13} "
        f"{'goal':>7}"
    )
    for name, (_, lengths) in cases.items():
        tokens, steps = sum(lengths), max(lengths)
        base = timed[(name, "generate")]

        def med(side: str, i: int, base=base, name=name) -> tuple[float, float]:
            own = timed[(name, side)]
            ratios = [b[i] / o[i] for b, o in zip(base, own, strict=True)]
            return statistics.median(o[i] for o in own), statistics.median(ratios)

        b = statistics.median(x[0] for x in base)
        (s, s_ratio), (v, v_ratio) = med("SGLang", 0), med("vLLM", 0)
        s_cpu, v_cpu = med("SGLang", 1)[1], med("vLLM", 1)[1]
        print(
            f"{name:<8} {tokens:>6} {tokens / b:>14.1f} {1000 * b / steps:>7.1f} "
            f"{tokens / s:>12.1f} {1000 * s / steps:>7.1f} {s_ratio:>5.2f} {tokens / v:>10.1f} "
            f"{v_ratio:>5.2f} {s_cpu:>6.2f}/{v_cpu:<6.2f} {'>= ' + str(GOALS[name]) + 'x':>7}"
        )
    for name in cases:
        for side in ("SGLang", "vLLM"):
            runs = timed[(name, side + " steps")]
            steps = sum(r[1] for r in runs)
            ms = sum(r[1] * r[2] for r in runs) / max(steps, 1)
            busy = statistics.median(r[0] for r in runs) if runs else float("nan")
            wall = statistics.median(w for w, _ in timed[(name, side)])
            print(
                f"server ({name}, {side}): {steps / args.reps:.0f} decode steps per run at "
                f"{ms:.2f} ms/step, {sum(r[3] for r in runs) / args.reps:.0f} prefills; busy "
                f"{busy:.2f} s of the client's {wall:.2f} s"
            )
    print(
        "ratio: generate wall time / server wall time (tokens/s, higher is better); cpu ratio: "
        "the same with CPU seconds (baseline process vs server process, all its threads); "
        "ms/step: wall time / longest sequence, prefill included"
    )


if __name__ == "__main__":
    main()
