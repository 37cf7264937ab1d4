"""Benchmark: one RL training step in the "prefix" micro-batch layout against "pad".

In this process, one backend per layout (the same config, model and seed) trains the same GRPO
batch: `--prompts` chat prompts ("What is a + b?" through the model's own template, the default
system prompt included) x `--samples` responses of random tokens, 2/3 to all of `--new` long
(the prompt untrained, the response trained; one response in four ending with an untrained span
of 2 tokens, a tool's output). A step is forward + backward + optimizer step; rounds interleave
the layouts, and the first round warms up. Prints seconds per step (median over rounds), the
tokens each layout computed, and the ratio against "pad". The default config is SmolLM2's LoRA
config with its CPU settings; `--set KEY=VALUE` overrides as train.py does.
OpenMP waits are the entry points' (`rollouts/openmp.py`), set before torch loads.

    python scripts/bench_prefix_layout.py [--config configs/smollm2-lora-cpu.toml] \\
        [--threads 2] [--rounds 5] [--prompts 4] [--samples 8] [--new 12] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()

import torch  # noqa: E402

from rollouts.config import Config, load_config  # noqa: E402
from rollouts.models.sources import fetch_source  # noqa: E402
from rollouts.trainer.factories import create_pytorch_backend  # noqa: E402
from rollouts.types import PlainLoss, TrainBatch  # noqa: E402
from tests.training.backend_helpers import masked_nll  # noqa: E402

CPU_SETTINGS = [  # configs/smollm2-lora-cpu.toml as the 3-minute SmolLM2 run trains
    "training.autocast='bfloat16'",
    "training.device='cpu'",
]


def grpo_batch(tokenizer, prompts: int, samples: int, new: int, seed: int) -> TrainBatch:
    """`prompts` chat prompts x `samples` random responses (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    vocab = len(tokenizer)
    for k in range(prompts):
        chat = [{"role": "user", "content": f"What is {3 + 7 * k % 27} + {11 + 5 * k % 19}?"}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompt = torch.tensor(list(prompt["input_ids"]) if hasattr(prompt, "keys") else prompt)
        for j in range(samples):
            n = int(torch.randint(max(1, 2 * new // 3), new + 1, (1,), generator=g))
            response = torch.randint(3, vocab, (n,), generator=g)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(n)])
            if j % 4 == 3 and n > 3:
                mask[-3:-1] = 0.0
            ids.append(torch.cat([prompt, response]))
            masks.append(mask)
    return TrainBatch(
        input_ids=tuple(ids),
        loss_mask=tuple(masks),
        num_global_tokens=float(sum(m.sum() for m in masks)),
        num_global_seqs=float(len(ids)),
    )


def with_layout(config: Config, layout: str) -> Config:
    training = dataclasses.replace(config.training, micro_batch_layout=layout)
    return dataclasses.replace(config, training=training)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-lora-cpu.toml")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new", type=int, default=12, help="the longest response, in tokens")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config, CPU_SETTINGS + args.set)
    if config.model.source:  # converted once into the model cache, as train.py does
        path = str(fetch_source(config.model.source, config.model.path or None))
        model = dataclasses.replace(config.model, path=path, source="")
        config = dataclasses.replace(config, model=model)
    backends = {
        name: create_pytorch_backend(with_layout(config, name)) for name in ("pad", "prefix")
    }
    batch = grpo_batch(backends["pad"].tokenizer, args.prompts, args.samples, args.new, seed=0)
    loss = PlainLoss(fn=masked_nll)
    times: dict[str, list[float]] = {name: [] for name in backends}
    computed: dict[str, float] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, backend in backends.items():
            start = time.perf_counter()
            metrics = backend.forward_backward(batch, loss).result()
            backend.optim_step().result()
            if r:
                times[name].append(time.perf_counter() - start)
            computed[name] = metrics["computed_tokens"]
    tokens = sum(len(x) for x in batch.input_ids)
    print(
        f"one step of {len(batch.input_ids)} sequences ({args.prompts} prompts x {args.samples}, "
        f"{tokens} tokens), {config.model.path}, {args.threads} thread(s), "
        f"micro_batch_tokens {config.training.micro_batch_tokens}; medians of {args.rounds} rounds"
    )
    base = statistics.median(times["pad"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:7s} {med:6.3f} s/step  {computed[name]:6.0f} tokens computed  "
            f"{base / med:.2f}x pad"
        )


if __name__ == "__main__":
    main()
