"""Benchmark: the built-in engine's decode step, its own (`fast_decode`) against the HF forward.

In this process, one RunningBatch per variant generates the same batch (a rollout's shape:
`--prompts` chat prompts x `--samples` seeded samples each, `--new` tokens, EOS ignored), rounds
interleaved; prints ms per decode step (the median over rounds) and each variant's speed against
the first (`hf` in fp32 by default). The default model is the demo's tiny Llama (hidden 128, 3
layers, a char tokenizer), built here; `--model DIR` takes an HF model directory (SmolLM2, ...).
OpenMP waits are the entry points' (`rollouts/openmp.py`), set before torch loads.

    python scripts/bench_decode_path.py [--model DIR] [--threads 1] [--rounds 5] \\
        [--variants hf:float32,fast:float32,fast:bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence  # noqa: E402
from rollouts.engine.sampling import SamplingSpec  # noqa: E402
from rollouts.models.tiny import TinyModelSpec, make_tiny_model  # noqa: E402

PATHS = {"hf": "hf", "fast": "auto"}  # variant name -> BatchOptions.decode


def prompts_of(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts of the demo's kind ("a+b")."""
    out = []
    for i in range(count):
        chat = [{"role": "user", "content": f"{10 + i % 80}+{20 + (i * 7) % 70}"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


def generate(model, tokenizer, prompts, samples: int, new: int, decode: str, seed: int) -> float:
    """Seconds per decode step of one batch: every prompt x `samples`, `new` tokens each."""
    rows = len(prompts) * samples
    options = BatchOptions(
        max_batch=rows,
        max_prefill=rows,
        pad_token_id=0,
        eos_token_ids=(),
        logprobs_from="raw",
        decode=decode,
    )
    batch = RunningBatch(model, tokenizer, options)
    spec = SamplingSpec(temperature=1.0, ignore_eos=True)
    seqs = [
        Sequence(
            rid=str(i),
            prompt_ids=prompts[i // samples],
            spec=spec,
            max_new=new + 1,
            notify=lambda s: None,
            seed=seed * rows + i,
        )
        for i in range(rows)
    ]
    with torch.inference_mode():
        batch.admit(seqs)
        start = time.perf_counter()
        for _ in range(new - 1):
            batch.step()
        return (time.perf_counter() - start) / (new - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="an HF model directory (default: the demo's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="new tokens (decode steps + 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="hf:float32,fast:float32,fast:bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = [v.split(":") for v in args.variants.split(",")]
    for path, dtype in variants:
        if path not in PATHS or dtype not in ("float32", "bfloat16", "float16"):
            parser.error(f"--variants: PATH:DTYPE with PATH in {sorted(PATHS)}, got {path}:{dtype}")
    model_dir = args.model
    if not model_dir:
        sizes = dict(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=512)
        spec = TinyModelSpec(**sizes, max_position_embeddings=256)
        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-decode-")), spec))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        for dtype in {d for _, d in variants}
    }
    prompts = prompts_of(tokenizer, args.prompts)
    times: dict[str, list[float]] = {f"{p}:{d}": [] for p, d in variants}
    for r in range(args.rounds + 1):  # round 0 warms up
        for path, dtype in variants:
            model = models[dtype]
            took = generate(model, tokenizer, prompts, args.samples, args.new, PATHS[path], r)
            if r:
                times[f"{path}:{dtype}"].append(took)
    rows = args.prompts * args.samples
    print(
        f"decode steps of {rows} rows ({args.prompts} prompts x {args.samples}), {args.new} new "
        f"tokens, {args.threads} thread(s), {model_dir}; medians of {args.rounds} rounds"
    )
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:16s} {med * 1e3:7.2f} ms/step  {base / med:.2f}x the first")


if __name__ == "__main__":
    main()
