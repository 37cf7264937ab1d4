"""Benchmark: AdamW's step on CPU, per implementation, over a real model's parameters.

PyTorch picks the single-tensor loop for CPU parameters (`foreach` and `fused` default to CUDA
only). This times one `optimizer.step()` over the parameters of `--model` (default SmolLM2-135M,
fp32 master weights as the trainer holds them) for the loop, `foreach=True` and `fused=True`,
interleaved rounds in this process, with the same gradients; and, after `--steps` updates from
the same start, the largest difference of each one's weights from the loop's.

    python scripts/bench_adamw.py [--model DIR] [--threads 2] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

KINDS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def params_of(model_dir: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [p.detach().clone() for p in lm.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path.home() / ".cache/rollouts/models/smollm2-135m-instruct"
    parser.add_argument("--model", default=str(default))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = params_of(args.model)
    n = sum(p.numel() for p in start)
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) * 1e-3 for p in start] for _ in range(args.steps)]
    weights, opts = {}, {}
    for kind, kw in KINDS.items():
        weights[kind] = [torch.nn.Parameter(p.clone()) for p in start]
        opts[kind] = torch.optim.AdamW(weights[kind], lr=3e-5, weight_decay=0.01, **kw)
    # the same updates from the same start: how far each lands from the loop's weights
    for step_grads in grads:
        for kind in KINDS:
            for p, g in zip(weights[kind], step_grads, strict=True):
                p.grad = g.clone()
            opts[kind].step()
    diff = {
        kind: max(
            float((a - b).abs().max()) for a, b in zip(weights[kind], weights["loop"], strict=True)
        )
        for kind in KINDS
    }
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            started = time.perf_counter()
            opts[kind].step()
            times[kind].append(time.perf_counter() - started)
    base = statistics.median(times["loop"])
    print(f"{n / 1e6:.1f} M fp32 parameters, {args.threads} threads, {args.rounds} rounds")
    print(f"{'kind':>8} {'median s/step':>14} {'vs loop':>8} {'max |w - loop w|':>18}")
    for kind in KINDS:
        median = statistics.median(times[kind])
        print(f"{kind:>8} {median:>14.4f} {base / median:>7.2f}x {diff[kind]:>18.3g}")


if __name__ == "__main__":
    main()
