"""Time the RL loss + backward for a [64, 2048] batch against plain cross-entropy, same process.

Two comparisons on the same tensors:
  logprobs: `make_loss_fn` (PPO dual clip + TIS + k3 KL + entropy, token-mean) from per-token
            logprobs vs the SFT loss on those logprobs (-sum(logp * M) / N);
  logits:   log_softmax + gather + the same loss vs `F.cross_entropy` from logits [B, T, V].
Prints ms per call and the ratio (RL / baseline).
Usage: python scripts/bench_losses.py [--device cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from bench_timing import timed

from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.config import AlgorithmConfig, KLConfig, RolloutCorrectionConfig
from rollouts.types import ModelOutputs, TrainBatch


def make_batch(b: int, t: int, device: str, gen: torch.Generator) -> TrainBatch:
    mask = torch.ones(b, t)
    mask[:, : t // 8] = 0  # a prompt
    n = float(mask.sum())

    def rows(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.to(device))

    batch = TrainBatch(
        input_ids=rows(torch.zeros(b, t, dtype=torch.long)),
        loss_mask=rows(mask),
        advantages=rows(torch.randn(b, t, generator=gen)),
        rollout_logprobs=rows(-torch.rand(b, t, generator=gen)),
        old_logprobs=rows(-torch.rand(b, t, generator=gen)),
        ref_logprobs=rows(-torch.rand(b, t, generator=gen)),
        num_global_tokens=n,
        num_global_seqs=float(b),
        max_response_length=t,
    )
    return batch


def bench_logprobs(batch: TrainBatch, device: str, reps: int) -> tuple[float, float]:
    config = AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(tis=True),
        kl=KLConfig(coef=0.05),
        entropy_coef=0.001,
        clip_eps_high=0.28,
    )
    loss_fn = make_loss_fn(config)
    logp = (-torch.rand(len(batch), batch.input_ids[0].shape[0]) - 0.01).to(device)
    logp.requires_grad_(True)
    ent = torch.rand_like(logp).requires_grad_(True)
    mask = torch.stack(batch.loss_mask)

    def rl() -> None:
        outputs = ModelOutputs(logprobs=tuple(logp), entropy=tuple(ent))
        loss, _ = loss_fn(outputs, batch)
        loss.backward()

    def sft() -> None:
        (-(logp * mask).sum() / batch.num_global_tokens).backward()

    return timed(rl, device, reps), timed(sft, device, reps)


def bench_logits(batch: TrainBatch, vocab: int, device: str, reps: int) -> tuple[float, float]:
    loss_fn = make_loss_fn(
        AlgorithmConfig(
            rollout_correction=RolloutCorrectionConfig(tis=True),
            kl=KLConfig(coef=0.05),
            clip_eps_high=0.28,
        )
    )
    b, t = len(batch), batch.input_ids[0].shape[0]
    logits = torch.randn(b, t, vocab, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (b, t), device=device)
    mask = torch.stack(batch.loss_mask)
    batch = dataclasses.replace(batch, input_ids=tuple(targets))

    def rl() -> None:
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss, _ = loss_fn(ModelOutputs(logprobs=tuple(logp)), batch)
        loss.backward()

    def ce() -> None:
        per_token = F.cross_entropy(logits.view(-1, vocab), targets.view(-1), reduction="none")
        ((per_token * mask.view(-1)).sum() / batch.num_global_tokens).backward()

    return timed(rl, device, reps), timed(ce, device, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(args.batch, args.seq, args.device, gen)
    shape = f"[{args.batch}, {args.seq}]"
    rl, base = bench_logprobs(batch, args.device, args.reps)
    threads = torch.get_num_threads()
    print(f"device {args.device} ({threads} CPU threads), batch {shape}, median of {args.reps}")
    print(
        f"from logprobs: rl loss+backward {rl * 1e3:.2f} ms, sft nll {base * 1e3:.2f} ms, "
        f"ratio {rl / base:.2f}"
    )
    rl, base = bench_logits(batch, args.vocab, args.device, args.reps)
    print(
        f"from logits (V={args.vocab}): rl loss+backward {rl * 1e3:.2f} ms, "
        f"cross-entropy {base * 1e3:.2f} ms, ratio {rl / base:.2f}"
    )


if __name__ == "__main__":
    main()
