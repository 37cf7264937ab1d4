"""Benchmark: the LM head's softmax statistics in row blocks against autograd, in one process.

The trainer reads each target token's logprob (and an entropy) from the LM head's logits.
`rollouts/trainer/logit_stats.py` computes them forward and backward in row blocks that stay in
the CPU's cache; the baseline is autograd through `log_softmax(logits.float()).gather(...)`, as
the trainer did before. Each variant runs the head's matmul (bf16 autocast on fp32 weights, as
training does), the statistics and the backward pass; "matmul only" is the head's matmuls alone
(a floor). Variants alternate, `--reps` each, medians reported; the overhead is a variant's time
beyond the floor. The gradients of the two are compared too.

    python scripts/bench_logit_stats.py [--tokens 2048] [--hidden 576] [--vocab 49152]
                                        [--threads 2] [--reps 7] [--entropy]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollouts.trainer.logit_stats import logit_stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--entropy", action="store_true", help="also an entropy metric (no grad)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(a.vocab, a.hidden, generator=gen) * 0.02).requires_grad_()
    hidden = torch.randn(a.tokens, a.hidden, generator=gen).requires_grad_()
    ids = torch.randint(0, a.vocab, (a.tokens, 1), generator=gen)

    def logits() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(hidden, weight)

    def autograd_stats() -> None:
        logp = F.log_softmax(logits().float(), dim=-1)
        loss = logp.gather(-1, ids).sum()
        if a.entropy:
            with torch.no_grad():
                _ = -(logp.exp() * logp).sum(-1)
        loss.backward()

    def block_stats() -> None:
        lp, _ = logit_stats(logits(), ids, a.entropy, False)
        lp.sum().backward()

    def matmul_only() -> None:
        x = logits()
        x.backward(torch.ones_like(x))

    variants = {"autograd": autograd_stats, "blocks": block_stats, "matmul only": matmul_only}
    grads = {}
    for name in ("autograd", "blocks"):
        weight.grad = hidden.grad = None
        variants[name]()
        grads[name] = weight.grad.clone()
    diff = (grads["autograd"] - grads["blocks"]).abs().max().item()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.reps):
        for name, fn in variants.items():
            weight.grad = hidden.grad = None
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["matmul only"]
    print(
        f"LM head [{a.tokens} x {a.hidden}] @ [{a.hidden} x {a.vocab}], bf16 autocast, "
        f"{a.threads} threads, entropy metric: {a.entropy}; medians of {a.reps}:"
    )
    for name, m in med.items():
        extra = "" if name == "matmul only" else f", beyond the matmuls {m - floor:.3f} s"
        print(f"  {name:12s} {m:.3f} s{extra}")
    ratio = (med["autograd"] - floor) / max(med["blocks"] - floor, 1e-9)
    print(
        f"  blocks / autograd: {med['autograd'] / med['blocks']:.2f}x the whole head, "
        f"{ratio:.1f}x less time beyond its matmuls; max |weight grad difference| {diff:.2e} "
        f"(largest {grads['autograd'].abs().max().item():.2e})"
    )


if __name__ == "__main__":
    main()
