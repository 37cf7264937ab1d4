"""Benchmark: a step's TrainBatch built, and pickled as the FSDP mirror broadcasts it.

    python scripts/bench_batch_wire.py [--samples 8192] [--rounds 3]

Samples of `bench_driver.py`'s lengths (prompts lognormal around 150 tokens, responses median
600, at most 4096), 16 to a group, GRPO. Part 1: `build_train_batch` (advantages and the
TrainBatch, each field one buffer cut into per-sample views), then each field packed for the
trainer link (`ragged`) for the batch and its 4 mini-batches, as a step sends them; against a
tensor per sample and field, as they were built before from the same primitives
(`long_tensor`, `mask_tensor`, `float_tensor`), packed the same way (each field concatenated).
Part 2: the batch through `pickle.dumps` + `pickle.loads`, as `mirror.py`'s
`broadcast_object_list` sends a call's arguments to the other ranks: the fields as one buffer
each (`TrainBatch.__reduce__`) against the same fields as separate tensors, which torch pickles
one by one (what the mirror sent before). Best of `--rounds`, both in this process.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import time
from typing import Any

import torch

from rollouts.algorithms.batch import build_train_batch
from rollouts.algorithms.tensors import float_tensor, long_tensor, mask_tensor
from rollouts.config import AlgorithmConfig
from rollouts.ragged import ragged
from rollouts.types import Sample, Status, TrainBatch

PER_SEQUENCE = ("input_ids", "loss_mask", "advantages", "rollout_logprobs")


def groups_of(samples: int, seed: int) -> list[tuple[Sample, ...]]:
    rng = random.Random(seed)
    out = []
    for g in range(samples // 16):
        prompt_len = min(max(int(rng.lognormvariate(5.0, 0.6)), 10), 1500)
        prompt = tuple(rng.randrange(100, 49000) for _ in range(prompt_len))
        row = []
        for _ in range(16):
            n = min(max(int(rng.lognormvariate(6.4, 0.9)), 8), 4096)
            row.append(
                Sample(
                    index=g,
                    group_index=g,
                    prompt="p",
                    tokens=prompt + tuple(rng.randrange(100, 49000) for _ in range(n)),
                    loss_mask=(0,) * prompt_len + (1,) * n,
                    response_length=n,
                    rollout_logprobs=tuple(-abs(rng.gauss(0.0, 1.5)) for _ in range(n)),
                    reward=float(rng.random() < 0.5),
                    status=Status.COMPLETED,
                )
            )
        out.append(tuple(row))
    return out


def per_sample_fields(groups: list[tuple[Sample, ...]]) -> dict[str, tuple[torch.Tensor, ...]]:
    """The four per-token fields as a tensor per sample (the advantage: its group's GRPO
    score broadcast over the mask), and each mask's sum: the per-sample work of before."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in PER_SEQUENCE}
    for group in groups:
        scores = torch.tensor([float(s.reward) for s in group])
        adv = (scores - scores.mean()) / (scores.std() + 1e-6)
        for i, s in enumerate(group):
            mask = mask_tensor(s.loss_mask)
            out["input_ids"].append(long_tensor(s.tokens))
            out["loss_mask"].append(mask)
            out["advantages"].append(float(adv[i]) * mask)
            lp = torch.zeros(len(s.tokens))
            lp[s.prompt_length :] = float_tensor(s.rollout_logprobs)
            out["rollout_logprobs"].append(lp)
            float(mask.sum())
    return {k: tuple(v) for k, v in out.items()}


def sent(fields: dict[str, tuple[torch.Tensor, ...]], minis: int = 4) -> int:
    """Pack each field for the link (`ragged`), for the batch and for each of its `minis`
    mini-batches (contiguous runs); the bytes packed."""
    total, n = 0, len(fields["input_ids"])
    cuts = [(0, n)] + [(k * n // minis, (k + 1) * n // minis) for k in range(minis)]
    for lo, hi in cuts:
        for tensors in fields.values():
            total += ragged(tensors[lo:hi]).flat.nbytes
    return total


def best(fn: Any, rounds: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(rounds):
        out = None
        gc.collect()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    groups = groups_of(args.samples, args.seed)
    tokens = sum(len(s.tokens) for g in groups for s in g)
    print(
        f"{args.samples} samples, {tokens / 1e6:.1f} M tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    config = AlgorithmConfig()

    def before() -> dict[str, tuple[torch.Tensor, ...]]:
        fields = per_sample_fields(groups)
        sent(fields)
        return fields

    def after() -> TrainBatch:
        batch = build_train_batch(groups, config)
        sent({name: getattr(batch, name) for name in PER_SEQUENCE})
        return batch

    old_s, fields = best(before, args.rounds)
    new_s, batch = best(after, args.rounds)
    for name in PER_SEQUENCE:
        assert all(
            torch.equal(a, b) for a, b in zip(fields[name], getattr(batch, name), strict=True)
        ), name
    print(
        f"build and pack: a tensor per sample {old_s:.3f} s, one buffer per field "
        f"{new_s:.3f} s: "
        f"{old_s / new_s:.2f}x"
    )

    def round_trip(value: Any) -> tuple[int, Any]:
        raw = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return len(raw), pickle.loads(raw)

    separate = tuple(tuple(t.clone() for t in getattr(batch, name)) for name in PER_SEQUENCE)
    old_s, (old_bytes, _) = best(lambda: round_trip(separate), args.rounds)
    new_s, (new_bytes, back) = best(lambda: round_trip(batch), args.rounds)
    assert all(torch.equal(a, b) for a, b in zip(batch.advantages, back.advantages, strict=True))
    print(
        f"pickle + unpickle: a tensor per sample {old_s:.3f} s ({old_bytes / 2**20:.0f} MB), "
        f"one buffer per field {new_s:.3f} s ({new_bytes / 2**20:.0f} MB): {old_s / new_s:.1f}x"
    )


if __name__ == "__main__":
    main()
