"""Where a decode step of the built-in engine goes, against `generate`'s, under torch.profiler;
then the same steps unprofiled: the default decode (CUDA graphs on a GPU) against the eager one.

The engine's running batch (`RunningBatch`, in process: no HTTP) and HF `generate` decode the
same rows (prompts of 4 tokens, sampled at temperature 1, EOS ignored). First the eager engine
step (`--decode eager`) and generate, each profiled over `--steps` decode steps after a warm-up:
ms per step, the top operators by self CPU time (and by device time on CUDA), the count of
host-device synchronisations (`aten::item`, `aten::_local_scalar_dense`,
`cudaStreamSynchronize`, D2H copies) per step. Then `--rounds` unprofiled rounds of the engine
with `--decode auto`, with `--decode eager` and generate, alternating; the best of each and the
ratios.

    python scripts/profile_decode.py [--device cuda --dtype bfloat16] [--rows 256] \\
        [--hidden 1024 --layers 24 --heads 16 --intermediate 4096] [--steps 32] [--rounds 2]
    taskset -c 1 python scripts/profile_decode.py --model smollm2 --dtype bfloat16 --rows 128 \\
        --threads 1   # a real model on one core

On one H200 (2026-11-26, the ~0.4B model, 256 rows): auto (CUDA graphs) 5.31 ms a step, eager
21.85 ms, generate 25.92 ms: 4.12x and 4.88x.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence
from rollouts.engine.sampling import SamplingSpec
from rollouts.models.sources import fetch_source
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_steps(
    model,
    tok,
    prompts: list[list[int]],
    steps: int,
    device,
    decode: str,
    profiled: bool,
    **options: bool,
) -> tuple[float, object]:
    """(seconds per decode step, profiler or None) of the running batch over `steps` steps;
    `options`: more of its `BatchOptions` (`share_prefix`, `cache_blocks`)."""
    batch_options = BatchOptions(
        max_batch=len(prompts),
        max_prefill=len(prompts),
        pad_token_id=0,
        eos_token_ids=(),
        logprobs_from="raw",
        decode=decode,
        **options,
    )
    batch = RunningBatch(model, tok, batch_options)
    spec = SamplingSpec(temperature=1.0, ignore_eos=True)
    seqs = [
        Sequence(rid=str(i), prompt_ids=p, spec=spec, max_new=steps + 8, notify=lambda s: None)
        for i, p in enumerate(prompts)
    ]
    with torch.inference_mode():
        batch.admit(seqs)
        for _ in range(4):
            batch.step()
        sync(device)
        with maybe_profile(device, profiled) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                batch.step()
            sync(device)
            took = (time.perf_counter() - start) / steps
    print(f"engine decode path: {batch.decode_path}", file=sys.stderr)
    return took, prof


def maybe_profile(device: torch.device, profiled: bool):
    return profile(activities=activities(device)) if profiled else contextlib.nullcontext()


def generate_steps(
    model, prompts: list[list[int]], steps: int, device, profiled: bool
) -> tuple[float, object]:
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
        with maybe_profile(device, profiled) as prof:
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
    parser.add_argument("--rounds", type=int, default=2, help="unprofiled rounds")
    parser.add_argument("--model", default="", help="a model directory, or smollm2 (not tiny)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        max_position_embeddings=max(512, 2 * args.steps + 64),
    )
    if args.model == "smollm2":
        model_dir = fetch_source("smollm2-135m-instruct")
    elif args.model:
        model_dir = Path(args.model)
    else:
        model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="profile-decode-")), spec)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[5 + i % 7, 6, 7, 8 + i % 5] for i in range(args.rows)]
    ours = engine_steps(model, tok, prompts, args.steps, device, "eager", True)
    theirs = generate_steps(model, prompts, args.steps, device, True)
    report("engine (RunningBatch.step, --decode eager)", *ours, args.steps, device)
    report("generate", *theirs, args.steps, device)
    print(
        f"\nunder the profiler: engine {ours[0] * 1e3:.2f} ms/step, generate "
        f"{theirs[0] * 1e3:.2f} ms/step: engine/generate speed {theirs[0] / ours[0]:.2f}x "
        f"({args.rows} rows, {args.device} {args.dtype}, hidden {args.hidden}, "
        f"{args.layers} layers)"
    )
    # the same steps unprofiled, rounds alternating: the default decode (CUDA graphs on a GPU)
    # against the eager step and generate
    times: dict[str, list[float]] = {"auto": [], "eager": [], "generate": []}
    for _ in range(args.rounds):
        for decode in ("auto", "eager"):
            took = engine_steps(model, tok, prompts, args.steps, device, decode, False)[0]
            times[decode].append(took)
        times["generate"].append(generate_steps(model, prompts, args.steps, device, False)[0])
    best = {name: min(ts) for name, ts in times.items()}
    print(
        f"unprofiled, best of {args.rounds}: engine --decode auto {best['auto'] * 1e3:.2f} "
        f"ms/step, --decode eager {best['eager'] * 1e3:.2f}, generate "
        f"{best['generate'] * 1e3:.2f}; auto/eager speed {best['eager'] / best['auto']:.2f}x, "
        f"auto/generate speed {best['generate'] / best['auto']:.2f}x"
    )


if __name__ == "__main__":
    main()
