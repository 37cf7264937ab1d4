"""Where a decode step of the built-in engine goes, against `generate`'s, under torch.profiler.

The engine's running batch (`RunningBatch`, in process: no HTTP) and HF `generate` decode the
same rows (prompts of 4 tokens, sampled at temperature 1, EOS ignored); each is profiled over
`--steps` decode steps after a warm-up. Prints ms per step for both, and the top operators by
self CPU time (and by device time on CUDA), with the count of host-device synchronisations
(`aten::item`, `aten::_local_scalar_dense`, `cudaStreamSynchronize`, D2H copies) per step.

    python scripts/profile_decode.py [--device cuda --dtype bfloat16] [--rows 256] \\
        [--hidden 1024 --layers 24 --heads 16 --intermediate 4096] [--steps 32]

On the H100 (2026-11-26) the server's decode step took 52.8 ms against generate's 16.6 ms on the
~0.4B model at 256 rows (scripts/bench_engine.py); this says where.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.inference.server.batch import BatchOptions, RunningBatch, Sequence
from rollouts.inference.server.sampling import SamplingSpec
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_steps(model, tok, prompts: list[list[int]], steps: int, device) -> tuple[float, object]:
    """(seconds per decode step, profiler) of the running batch over `steps` steps."""
    options = BatchOptions(
        max_batch=len(prompts),
        max_prefill=len(prompts),
        pad_token_id=0,
        eos_token_ids=(),
        logprobs_from="raw",
    )
    batch = RunningBatch(model, tok, options)
    spec = SamplingSpec(temperature=1.0, ignore_eos=True)
    seqs = [
        Sequence(rid=str(i), prompt_ids=p, spec=spec, max_new=10_000, notify=lambda s: None)
        for i, p in enumerate(prompts)
    ]
    with torch.inference_mode():
        batch.admit(seqs)
        for _ in range(4):
            batch.step()
        sync(device)
        with profile(activities=activities(device)) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                batch.step()
            sync(device)
            took = (time.perf_counter() - start) / steps
    return took, prof


def generate_steps(model, prompts: list[list[int]], steps: int, device) -> tuple[float, object]:
    """(seconds per step, profiler) of `generate` over `steps` new tokens (prefill included,
    as one step of many)."""
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        sync(device)
        with profile(activities=activities(device)) as prof:
            start = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
            sync(device)
            took = (time.perf_counter() - start) / steps
    return took, prof


def activities(device: torch.device) -> list[ProfilerActivity]:
    cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    return [ProfilerActivity.CPU, *cuda]


def report(name: str, took: float, prof, steps: int, device: torch.device) -> None:
    events = prof.key_averages()
    syncs = {e.key: e.count / steps for e in events if e.key in SYNC_OPS}
    print(f"\n== {name}: {took * 1e3:.2f} ms per step; per step: {syncs}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    if device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=0, help="0 = 4 x hidden")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        max_position_embeddings=max(512, 2 * args.steps + 64),
    )
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="profile-decode-")), spec)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[5 + i % 7, 6, 7, 8 + i % 5] for i in range(args.rows)]
    ours = engine_steps(model, tok, prompts, args.steps, device)
    theirs = generate_steps(model, prompts, args.steps, device)
    report("engine (RunningBatch.step)", *ours, args.steps, device)
    report("generate", *theirs, args.steps, device)
    print(
        f"\nengine {ours[0] * 1e3:.2f} ms/step, generate {theirs[0] * 1e3:.2f} ms/step: "
        f"engine/generate speed {theirs[0] / ours[0]:.2f}x ({args.rows} rows, {args.device} "
        f"{args.dtype}, hidden {args.hidden}, {args.layers} layers)"
    )


if __name__ == "__main__":
    main()
