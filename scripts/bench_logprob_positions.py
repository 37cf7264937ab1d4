"""Benchmark: one RL training step with the LM head on every position vs only on trained tokens.

`training.logprob_positions = "all"` (the baseline) against `"trained"` (the default): the same
RL-shaped batch as `bench_micro_batch.py` (16 groups x 8 samples, 22 untrained prompt tokens +
30-64 trained response tokens, GRPO), forward/backward + AdamW, one backend per setting in this
process, timed in interleaved rounds (the first left out). Prints the median seconds per step and
the speed-up. With `--model DIR` (SmolLM2-135M: a 49k vocabulary) the head is a fifth of a token's
compute, so the prompt positions it skips matter more than on the tiny demo model (259 tokens),
where the gain (about 1%) is within a 6-round run's noise: use `--rounds 15` there.

    python scripts/bench_logprob_positions.py [--model DIR] [--rounds 6] [--prompt 22]
                                              [--groups 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_micro_batch import (  # scripts/ is on sys.path when run
    bench_model,
    interleaved_steps,
    rl_groups,
    variant_backends,
)

from rollouts.algorithms.batch import build_train_batch
from rollouts.algorithms.loss_fn import make_loss_fn
from rollouts.driver.engines import cpu_share

SETTINGS = ("all", "trained")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="an HF model directory (default: tiny)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=22, help="untrained tokens per sample")
    parser.add_argument("--groups", type=int, default=16, help="groups of 8 samples per step")
    args = parser.parse_args()
    torch.set_num_threads(cpu_share(0, "cpu", 1))
    with tempfile.TemporaryDirectory(prefix="bench-lp-") as tmp:
        config, model_dir = bench_model(Path(tmp), args.model)
        variants = {p: {"logprob_positions": p} for p in SETTINGS}
        backends = variant_backends(config, model_dir, variants)
        vocab = backends["all"].lm.config.vocab_size
        groups = rl_groups(min(vocab, 40), prompt=args.prompt, groups=args.groups)
        batch = build_train_batch(groups, config.algorithm)
        loss_fn = make_loss_fn(config.algorithm)
        times, losses = interleaved_steps(backends, batch, loss_fn, args.rounds)
        for backend in backends.values():
            backend.close()
    base = statistics.median(times["all"])
    print(
        f"model {args.model or 'tiny (demo)'}, vocabulary {vocab}; first-step loss "
        + ", ".join(f"{p} {v:.6f}" for p, v in losses.items())
    )
    print(f"{'logprob_positions':>18} {'median s/step':>14} {'vs all':>8}")
    for positions in SETTINGS:
        median = statistics.median(times[positions])
        print(f"{positions:>18} {median:>14.3f} {base / median:>7.2f}x")


if __name__ == "__main__":
    main()
