"""Drive the engine's running batch in process (no HTTP): greedy outputs of many prompts through
a few slots, later prompts joining as earlier ones finish. Shared by the decode-path tests
(`test_fast_decode.py`: the fast step against HF's forward; `test_graphs.py`: the padded,
captured step against the unpadded one)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence
from rollouts.engine.sampling import SamplingSpec


def random_workload(seed: int, count: int, max_new: int) -> tuple[list[list[int]], list[int]]:
    """`count` prompts of 1-30 token ids in [3, 250) and 1-`max_new` new tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 30))] for _ in range(count)]
    return prompts, [rng.randint(1, max_new) for _ in prompts]


def greedy_through_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    lengths: list[int],
    *,
    max_batch: int,
    decode: str = "eager",
    step: Callable[..., Any] | None = None,
    admit_rng: random.Random | None = None,
    share_prefix: bool = True,
    batches: list[RunningBatch] | None = None,
    cache_blocks: bool = False,
) -> tuple[list[list[int]], list[list[float]], str]:
    """(outputs, logprobs, the batch's decode path) of every prompt, greedy, `lengths[i]` new
    tokens each (EOS ignored), through `max_batch` slots. `step` replaces the decode step;
    `admit_rng` admits a random number of the waiting prompts at a time (so the batch size
    keeps changing) instead of filling every free slot. `share_prefix`, `cache_blocks`: the
    batch's options; `batches` gets the batch (for its counters)."""
    options = BatchOptions(
        max_batch=max_batch,
        max_prefill=max_batch,
        pad_token_id=0,
        eos_token_ids=(),
        logprobs_from="raw",
        decode=decode,
        share_prefix=share_prefix,
        cache_blocks=cache_blocks,
    )
    batch = RunningBatch(model, tokenizer, options)
    if batches is not None:
        batches.append(batch)
    if step is not None:
        batch._decode_step = step
    outputs, logprobs = serve_on(batch, prompts, lengths, admit_rng)
    return outputs, logprobs, batch.decode_path


def serve_on(
    batch: RunningBatch,
    prompts: list[list[int]],
    lengths: list[int],
    admit_rng: random.Random | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """(outputs, logprobs) of every prompt, greedy, through `batch` (see `greedy_through_batch`)."""
    max_batch = batch.options.max_batch
    spec = SamplingSpec(temperature=0.0, ignore_eos=True)
    waiting = [
        Sequence(rid=str(i), prompt_ids=p, spec=spec, max_new=n, notify=lambda s: None)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    done: list[Sequence] = []
    with torch.inference_mode():
        while waiting or len(batch):
            free = max_batch - len(batch)
            if waiting and free:
                n = admit_rng.randint(1, free) if admit_rng is not None else free
                ready, waiting = waiting[:n], waiting[n:]
                done += batch.admit(ready)[1]
            if len(batch):
                done += batch.step()
    by_rid = {s.rid: s for s in done}
    seqs = [by_rid[str(i)] for i in range(len(prompts))]
    return [s.output_ids for s in seqs], [s.logprobs for s in seqs]
