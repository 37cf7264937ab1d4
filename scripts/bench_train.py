"""Benchmark the training backend and weight sync against plain baselines, in one process.

1. forward+backward tokens/s: PyTorchBackend.forward_backward (masked NLL) vs a hand-written
   PyTorch loop (model(ids).logits -> cross_entropy -> backward) on the same equal-length batch
   (no padding), with the default logprob chunk (sized by the vocabulary: 2730 tokens for
   SmolLM2, so a 2048-token micro-batch is one chunk) and with chunks of 1024 (less memory, the
   LM head recomputed in backward). Then the whole training step at the default chunk
   (forward_backward + optim_step) and its model FLOPs utilisation against `--peak-tflops`
   (on CUDA: 989, an H100's or H200's dense bf16): 6 x parameters (embeddings out, the LM head
   in) + 6 x layers x hidden x sequence (causal attention's matmuls) FLOPs per token.
2. padding fraction of the "pad" and "pack" layouts on a ragged batch.
3. weight sync to a running built-in engine, for the tiny model and a ~100M-parameter one: the
   disk path (weights-only files in /dev/shm + /update_weights_from_disk) and the distributed
   path (SGLang's protocol: gloo broadcast of flattened buckets) vs just save_file + load_file of
   the same safetensors.
Usage: python scripts/bench_train.py [--device cpu|cuda] [--hidden 256] [--layers 4] [--seq 256]
       python scripts/bench_train.py --device cuda --only train --hidden 1024 --layers 24 \
           --seq 1024 --batch 16   # the ~0.4B model of scripts/gpu_check.sh
       python scripts/bench_train.py --only sync [--sync-models 100m] [--bucket-mb 256]
       python scripts/bench_train.py --only compile [--profile] ...  # model.compile against
           eager: the whole train step of each, rounds alternating, the ratio printed
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import trio
from bench_timing import timed
from matmul_rate import shapes_of, train_rate
from safetensors.torch import load_file, save_file

from rollouts.config import Config, ModelConfig, OptimConfig, TrainingConfig
from rollouts.engine.launch import engine_server
from rollouts.heap import keep_freed_memory
from rollouts.inference.sglang import SGLangEngine
from rollouts.models.sources import fetch_source
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.batching import padding_fraction, plan_micro_batches
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.types import ModelOutputs, PlainLoss, TrainBatch
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.distributed import DistributedWeightSync, DistSyncOptions
from rollouts.weights.files import publish_weights


def masked_nll(outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked NLL normalised by the batch's token count."""
    total = sum(
        -(lp * m.to(lp.device)).sum()
        for lp, m in zip(outputs.logprobs, batch.loss_mask, strict=True)
    )
    return total / batch.num_global_tokens, {}


nll_loss = PlainLoss(fn=masked_nll)


def make_batch(lengths: list[int], vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(3, vocab, (n,), generator=g) for n in lengths)
    masks = tuple(torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in lengths)
    n_tok = float(sum(n - 1 for n in lengths))
    return TrainBatch(input_ids=ids, loss_mask=masks, num_global_tokens=n_tok)


def config_for(
    model_dir: Path,
    device: str,
    budget: int,
    chunk: int,
    compile: bool = False,
    autocast: str = "auto",
) -> Config:
    training = TrainingConfig(
        device=device,
        micro_batch_tokens=budget,
        logprob_chunk_size=chunk,
        rl_steps=10,
        autocast=autocast,
    )
    model = ModelConfig(path=str(model_dir), compile=compile)
    return Config(model=model, optim=OptimConfig(), training=training)


def bench_fwd_bwd(model_dir: Path, args: argparse.Namespace) -> None:
    lengths = [args.seq] * args.batch
    tokens = sum(lengths)
    batch = make_batch(lengths, 250)
    for chunk in (0, 1024):  # 0: the default, sized by the vocabulary (`auto_chunk_size`)
        config = config_for(model_dir, args.device, tokens, chunk, autocast=args.autocast)
        backend = create_pytorch_backend(config)
        size = backend.core.model.chunk_size
        lm, dev = backend.lm, backend.device
        ids = torch.stack(batch.input_ids).to(dev)

        def plain(lm: torch.nn.Module = lm, ids: torch.Tensor = ids, b=backend) -> None:
            lm.train()
            with b.core._autocast():
                logits = lm(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
            loss.backward()
            lm.zero_grad(set_to_none=True)

        def ours(backend=backend) -> None:
            backend.forward_backward(batch, nll_loss).result()
            backend.core.optimizer.zero_grad(set_to_none=True)

        t_plain, t_ours = [], []
        for _ in range(args.rounds):  # interleaved, so drift hits both
            t_plain.append(timed(plain, args.device, args.reps))
            t_ours.append(timed(ours, args.device, args.reps))
        tp, to = min(t_plain), min(t_ours)
        print(
            f"fwd+bwd [{args.batch}x{args.seq}] logprob_chunk={chunk or f'auto ({size})'}: backend "
            f"{tokens / to:,.0f} tok/s, plain loop {tokens / tp:,.0f} tok/s, "
            f"ratio {tp / to:.3f}x"
        )
        if chunk == 0:  # the whole step as a run trains it
            train_step_mfu(backend, batch, tokens, args)
        backend.close()


def flops_per_token(lm: torch.nn.Module, seq: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (input embeddings excluded, a tied
    LM head counted once as the head) + 6 x layers x hidden x seq for causal attention."""
    c = lm.config
    params = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    if c.tie_word_embeddings:
        params += c.vocab_size * c.hidden_size
    return 6.0 * params + 6.0 * c.num_hidden_layers * c.hidden_size * seq


def train_step_mfu(backend, batch: TrainBatch, tokens: int, args: argparse.Namespace) -> None:
    """The whole step (forward_backward + optim_step): tokens/s and MFU against the peak."""

    def step() -> None:
        backend.forward_backward(batch, nll_loss).result()
        backend.optim_step().result()

    took = min(timed(step, args.device, args.reps) for _ in range(args.rounds))
    flops = flops_per_token(backend.lm, args.seq) * tokens / took
    peak = args.peak_tflops or (989.0 if args.device == "cuda" else 0.0)
    mfu = f", MFU {100 * flops / (peak * 1e12):.1f}% of {peak:.0f} TFLOP/s" if peak else ""
    autocast = backend.core.settings.autocast_dtype
    print(
        f"train step [{args.batch}x{args.seq}] (forward_backward + optim_step, autocast "
        f"{autocast}): {took * 1e3:.1f} ms, {tokens / took:,.0f} tok/s, "
        f"{flops / 1e12:.1f} TFLOP/s{mfu}"
    )
    if args.device == "cpu":
        matmul_share(backend, tokens / took, min(tokens, backend_budget(backend)), autocast)


def backend_budget(backend) -> int:
    return backend.core.settings.micro_batch_tokens


def matmul_share(backend, tokens_per_s: float, rows: int, autocast) -> None:
    """The step's linear-layer FLOP/s (6 x the matmul parameters a token) against the bare rate
    of the same matmuls (forward, input and weight gradients) at a micro-batch's rows, in the
    step's matmul dtype, on this process's torch threads (`scripts/matmul_rate.py`)."""
    shapes = shapes_of(backend.lm.config)
    dtype = autocast or torch.float32
    rate = train_rate(shapes, rows, dtype, torch.get_num_threads())
    share = tokens_per_s * 6 * shapes.params / rate
    print(
        f"  bare {dtype} matmul rate at {rows} rows, {torch.get_num_threads()} threads: "
        f"{rate / 1e9:.1f} GFLOP/s; the step's linear layers at {100 * share:.0f}% of it"
    )


def bench_compile(model_dir: Path, args: argparse.Namespace) -> None:
    """The whole train step with `model.compile = true` against eager, in one process: both
    backends are built, the compiled one compiles in its warm-up, then rounds alternate."""
    lengths = [args.seq] * args.batch
    tokens = sum(lengths)
    batch = make_batch(lengths, 250)
    backends = {
        name: create_pytorch_backend(config_for(model_dir, args.device, tokens, 1024, compiled))
        for name, compiled in (("eager", False), ("compile", True), ("compile-foreach", True))
    }
    # the third: AdamW's foreach path (PyTorch's default on CUDA) in place of the fused one
    for group in backends["compile-foreach"].core.optimizer.param_groups:
        group["fused"], group["foreach"] = None, True

    def step_of(backend):
        def step() -> None:
            backend.forward_backward(batch, nll_loss).result()
            backend.optim_step().result()

        return step

    t0 = time.perf_counter()
    step_of(backends["compile"])()
    print(f"compile: first step (compiling) {time.perf_counter() - t0:.1f} s")
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            times[name].append(timed(step_of(backend), args.device, args.reps))
    flops = flops_per_token(backends["eager"].lm, args.seq) * tokens
    peak = args.peak_tflops or (989.0 if args.device == "cuda" else 0.0)
    for name, ts in times.items():
        took = min(ts)
        mfu = f", MFU {100 * flops / took / (peak * 1e12):.1f}%" if peak else ""
        print(
            f"train step [{args.batch}x{args.seq}] {name}: {took * 1e3:.1f} ms, "
            f"{tokens / took:,.0f} tok/s, {flops / took / 1e12:.1f} TFLOP/s{mfu}"
        )
    print(f"compile / eager: {min(times['eager']) / min(times['compile']):.2f}x per step")
    print(
        "fused AdamW / foreach (compiled): "
        f"{min(times['compile-foreach']) / min(times['compile']):.2f}x per step"
    )
    if args.profile:
        for name in ("eager", "compile"):
            backend = backends[name]
            print_profile(name, inline_step_of(backend, batch), args.device)
    for backend in backends.values():
        backend.close()


def inline_step_of(backend, batch: TrainBatch):
    """The same step on this thread (the backend's worker is idle between steps), so the
    profiler, which records the thread it runs on, sees the operators."""

    def step() -> None:
        backend.core.forward_backward(batch, nll_loss, False)
        backend.core.optim_step()  # clips the model's trainable parameters

    return step


def print_profile(name: str, step, device: str) -> None:
    """The top operators of one step, by device time on CUDA (self CPU time elsewhere)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(f"--- profile of one {name} step, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def bench_padding(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.seq // 8, args.seq + 1, (64,), generator=g).tolist()
    budget = args.seq * 8
    for layout in ("pad", "pack"):
        plans = plan_micro_batches(lengths, budget, layout)
        frac = padding_fraction(plans, lengths)
        print(
            f"padding fraction, {len(lengths)} ragged seqs ({min(lengths)}..{max(lengths)} "
            f"tokens), budget {budget}, layout={layout}: {frac:.3f} in {len(plans)} micro-batches"
        )


def save_load_safetensors(weights: dict[str, torch.Tensor], root: Path) -> float:
    t0 = time.perf_counter()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "plain.safetensors"))
    load_file(str(root / "plain.safetensors"))
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


async def bench_sync(model_dir: Path, label: str, args: argparse.Namespace) -> None:
    """One engine: disk path (publish + reload) vs distributed path (gloo broadcast of buckets)
    vs raw save_file + load_file of the same tensors, interleaved, medians after a warm-up."""
    backend = create_pytorch_backend(config_for(model_dir, args.device, 4096, 1024))
    shm = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    weights = backend.get_weights()
    n_params = sum(v.numel() for v in weights.values())
    size_mb = sum(v.numel() * v.element_size() for v in weights.values()) / 2**20
    options = DistSyncOptions(bucket_bytes=int(args.bucket_mb * 2**20), timeout_s=600.0)
    dist = DistributedWeightSync(options)
    disk, net, raw, phases = [], [], [], []
    async with engine_server(model_dir, weight_version="0") as url:
        engine = SGLangEngine(url)
        for i in range(-1, args.sync_reps):  # round -1 warms up (and forms the group)
            t0 = time.perf_counter()
            path = await trio.to_thread.run_sync(publish_weights, backend, shm / "w", f"{i}d")
            await sync_weights_to_engines([engine], path, f"{i}d")
            disk.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            report = await dist.sync([engine], backend.get_weights, f"{i}n")
            net.append(time.perf_counter() - t0)
            phases.append(report.metrics())
            raw.append(await trio.to_thread.run_sync(save_load_safetensors, weights, shm))
        await dist.close([engine])
        await engine.aclose()
    backend.close()
    shutil.rmtree(shm)
    d, n, r = (median(x[1:]) for x in (disk, net, raw))
    buckets = phases[-1].get("buckets", 0.0)
    load = median([p["load_s_max"] for p in phases[1:]])
    print(
        f"weight sync, {label}: {n_params / 1e6:.1f}M params, {size_mb:.1f} MiB fp32, 1 engine, "
        f"median of {args.sync_reps}"
    )
    print(f"  raw save_file + load_file (/dev/shm):         {r * 1e3:8.1f} ms  (baseline)")
    print(f"  disk path (weights-only in /dev/shm + reload): {d * 1e3:8.1f} ms  {d / r:5.2f}x raw")
    print(
        f"  distributed path (gloo, {buckets:.0f} bucket(s)):      {n * 1e3:8.1f} ms  "
        f"{n / r:5.2f}x raw; disk time / this = {d / n:.2f} (transfer {load * 1e3:.1f} ms)"
    )


SYNC_MODELS = {
    # ~100M parameters: 11 Llama layers of width 768 (9.4M each) over a byte vocabulary
    "100m": TinyModelSpec(
        hidden_size=768, num_layers=11, num_heads=12, intermediate_size=3072, seed=0
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--autocast", choices=("auto", "bfloat16", "off"), default="auto")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=0, help="0 = hidden / 64")
    parser.add_argument("--intermediate", type=int, default=0, help="0 = 4 x hidden")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="0: 989 on cuda")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("all", "train", "compile", "sync"), default="all")
    parser.add_argument("--profile", action="store_true", help="--only compile: profile a step")
    parser.add_argument("--sync-reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--sync-models", default="100m", help="extra models for the sync bench")
    parser.add_argument(
        "--malloc",
        choices=("keep", "system"),
        default="keep",
        help="keep: glibc keeps freed memory for reuse, as the driver and trainer process set "
        "it (rollouts/heap.py); system: glibc's defaults",
    )
    args = parser.parse_args()
    if args.malloc == "keep":
        print(f"malloc: freed memory kept for reuse: {keep_freed_memory()}")
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads or max(args.hidden // 64, 1),
        intermediate_size=args.intermediate or args.hidden * 4,
        max_position_embeddings=max(args.seq, 512),
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            model_dir = fetch_source("smollm2-135m-instruct")
            print(f"model: SmolLM2-135M-Instruct, device {args.device}")
        else:
            model_dir = make_tiny_model(Path(tmp) / "model", dataclasses.replace(spec))
            print(f"model: hidden {args.hidden}, {args.layers} layers, device {args.device}")
        if args.only in ("all", "train"):
            bench_fwd_bwd(model_dir, args)
            bench_padding(args)
        if args.only == "compile":
            bench_compile(model_dir, args)
        if args.only in ("all", "sync"):
            trio.run(
                bench_sync, model_dir, f"tiny (hidden {args.hidden}, {args.layers} layers)", args
            )
            for name in args.sync_models.split(","):
                if name:
                    big = make_tiny_model(Path(tmp) / name, SYNC_MODELS[name])
                    trio.run(bench_sync, big, name, args)


if __name__ == "__main__":
    main()
