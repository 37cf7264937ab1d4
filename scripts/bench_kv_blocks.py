"""Benchmark: the built-in engine's decode step over a KV cache in column blocks (`kv.BLOCK_COLS`,
what an engine starting on one CPU thread keeps) against one block of every column.

A column slice of one `[rows, heads, capacity, dim]` buffer is strided, and oneDNN's bf16
batched matmul copies such a slice before reading it; in blocks, each block's first b rows are
one contiguous tensor that the matmul reads in place, at the cost of a matmul per block and the
masked columns of partly used blocks. The engine's running batch (`RunningBatch`, in process, no
HTTP) decodes `--rows` rows whose prompts have `--prompt-tokens` tokens (a shared prefix off, so
every row attends over its own prompt), sampled at temperature 1, EOS ignored; for each prompt
length, rounds alternate between the two layouts. Prints ms per decode step (medians) and the
ratio.

    python scripts/bench_kv_blocks.py [--model smollm2] [--dtype bfloat16] [--threads 1] \\
        [--prompt-tokens 16,100,250] [--rows 128] [--steps 32] [--rounds 3]
    python scripts/bench_kv_blocks.py --model tiny   # the demo's tiny model (case A's shape)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()

import torch  # noqa: E402
from profile_decode import engine_steps  # noqa: E402  (this script's folder)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollouts.engine import kv  # noqa: E402


def step_s(model, tok, prompts: list[list[int]], steps: int, blocked: bool) -> float:
    """Seconds per decode step of the running batch over `steps` steps, its cache `blocked`
    (a shared prefix off: every row attends over its own prompt)."""
    cpu = torch.device("cpu")
    options = {"share_prefix": False, "cache_blocks": blocked}
    return engine_steps(model, tok, prompts, steps, cpu, "auto", False, **options)[0]


def model_dir_of(name: str) -> Path:
    if name == "smollm2":
        from rollouts.models.sources import fetch_source

        return fetch_source("smollm2-135m-instruct")
    if name == "tiny":  # the demo config's model, with room for the longest prompts here
        import dataclasses

        from rollouts.config import load_config
        from rollouts.driver.setup import tiny_spec
        from rollouts.models.tiny import make_tiny_model

        demo = tiny_spec(load_config(Path(__file__).resolve().parents[1] / "configs/demo-cpu.toml"))
        spec = dataclasses.replace(demo, max_position_embeddings=1024)
        return make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-kv-blocks-")), spec)
    return Path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", default="16,100,250")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = model_dir_of(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = min(len(tok), 4000)
    print(
        f"{model_dir.name} ({args.dtype}), {args.rows} rows, {args.steps} decode steps, "
        f"{args.threads} thread(s); medians of {args.rounds} rounds, alternating"
    )
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        prompts = [[5 + (i * 31 + j * 7) % (vocab - 5) for j in range(n)] for i in range(args.rows)]
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for blocked in (False, True):
                times[blocked].append(step_s(model, tok, prompts, args.steps, blocked))
        one, blocks = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"  prompts of {n:4d} tokens (attention over {n + 4}-{n + args.steps + 4} columns): "
            f"one block {one * 1e3:7.2f} ms/step, blocks of {kv.BLOCK_COLS} {blocks * 1e3:7.2f} "
            f"ms/step: {one / blocks:4.2f}x"
        )


if __name__ == "__main__":
    main()
