"""Benchmark: the built-in engine's token draw (`sampling.inverse_cdf`) against the draws it
replaced, alone and inside whole decode rounds of a real model; and `sampling.sample`'s logprob
of the drawn token (the log of its probability) against a log_softmax pass.

Baselines, run in this process: `torch.multinomial` (what unseeded rows used: an exponential per
vocabulary entry) and one float64 cumsum over the whole vocabulary with `searchsorted` (what
seeded rows used). Part 1 times the draw alone on `--rows` x `--vocab` probabilities. Part 2
runs the engine's running batch (`RunningBatch`, in process, no HTTP) over the RL rollout shape
of configs/smollm2-lora-cpu.toml: `--prompts` chat prompts x `--samples` rows, `--new` new
tokens at temperature 0.7, once with seeds and once without; the baseline swaps the old draw
back into `sampling` for its rounds. Part 3 times `sample` (temperature 1, raw logprobs: the
drawn token's logprob as the log of its probability) against the same draw with the logprob
from a log_softmax pass over the vocabulary (what `sample` did before), on `--rows` x `--vocab`
bf16 logits. Part 4 times the seeded rows' uniforms: `sampling.seeded_uniforms` (splitmix64 of
each row's seed and draw count, a few tensor ops for the batch) against a `torch.Generator` a
row (what seeded rows drew from before: a call and a store each), at 128 and 256 rows. Prints
the medians and the ratios.

    python scripts/bench_sampling.py [--model ~/.cache/rollouts/models/smollm2-135m-instruct] \\
        [--dtype bfloat16] [--threads 2] [--rounds 3]

2026-11-26, the 2-core CPU box, SmolLM2-135M in bf16, 10 prompts x 8 rows, 12 new tokens:
see docs/benchmarks.md ("The token draw").
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollouts.openmp import short_spin_waits

short_spin_waits()

import torch  # noqa: E402

from rollouts.engine import sampling  # noqa: E402
from rollouts.engine.batch import BatchOptions, RunningBatch, Sequence  # noqa: E402
from rollouts.engine.rows import SlotTable  # noqa: E402
from rollouts.engine.sampling import SamplingSpec  # noqa: E402

Draw = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def float64_cumsum_draw(probs_B_V: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The seeded rows' former draw: one float64 cumsum of the whole vocabulary."""
    cdf_B_V = probs_B_V.double().cumsum(dim=1)
    target_B1 = (u_B.double() * cdf_B_V[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf_B_V, target_B1, right=True).squeeze(1)
    return tokens.clamp_max(probs_B_V.shape[1] - 1)


def multinomial_draw(probs_B_V: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The unseeded rows' former draw (`u_B` unused: multinomial draws its own)."""
    return torch.multinomial(probs_B_V, 1).squeeze(1)


def timed(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def draw_alone(rows: int, vocab: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(rows, vocab, generator=g) * 3 / 0.7).softmax(dim=1)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    new = timed(lambda: sampling.inverse_cdf(probs, u), rounds * 10)
    print(f"part 1: the draw alone, {rows} rows x {vocab} vocabulary entries")
    print(f"  inverse_cdf (two levels)  {new * 1e3:7.2f} ms")
    for name, fn in (("float64 cumsum", float64_cumsum_draw), ("multinomial", multinomial_draw)):
        old = timed(lambda fn=fn: fn(probs, u), rounds * 10)
        print(f"  {name:24s}  {old * 1e3:7.2f} ms   inverse_cdf {old / new:5.1f}x faster")


def logprob_of_the_draw(rows: int, vocab: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    # the engine's own slot table builds the batch's sampling tensors, as in a decode step
    table = SlotTable(rows, torch.device("cpu"))
    table.admit([SamplingSpec(temperature=1.0)] * rows, [1] * rows, [None] * rows, ())
    batch = table.sampling(0, rows)

    def before() -> torch.Tensor:
        raw = logits.float()
        tokens = sampling.inverse_cdf(raw.softmax(dim=1), torch.rand(rows, dtype=torch.float64))
        return raw.log_softmax(dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)

    times: dict[str, list[float]] = {"before": [], "sample": []}
    for _ in range(rounds):  # interleaved
        times["before"].append(timed(before, 10))
        times["sample"].append(timed(lambda: sampling.sample(logits, batch, "raw"), 10))
    old, new = statistics.median(times["before"]), statistics.median(times["sample"])
    print(f"part 3: a draw and its logprob, {rows} rows x {vocab} bf16 logits, temperature 1")
    print(
        f"  log_softmax pass {old * 1e3:6.2f} ms   log of the probability {new * 1e3:6.2f} ms"
        f"   {old / new:4.2f}x faster"
    )


@contextlib.contextmanager
def draw_swapped(draw: Draw | None) -> Iterator[None]:
    """The engine's draw replaced by `draw` (None: the current one) for this block."""
    current = sampling.inverse_cdf
    if draw is not None:
        sampling.inverse_cdf = draw
    try:
        yield
    finally:
        sampling.inverse_cdf = current


def one_round(model, tok, prompts: list[list[int]], samples: int, new: int, seeded: bool) -> None:
    options = BatchOptions(
        max_batch=len(prompts) * samples,
        max_prefill=len(prompts) * samples,
        pad_token_id=0,
        eos_token_ids=(),
        logprobs_from="raw",
        decode="auto",
    )
    batch = RunningBatch(model, tok, options)
    spec = SamplingSpec(temperature=0.7, ignore_eos=True)
    seqs = [
        Sequence(
            rid=f"{i}-{j}",
            prompt_ids=prompt,
            spec=spec,
            max_new=new,
            notify=lambda s: None,
            seed=1000 * i + j if seeded else None,
        )
        for i, prompt in enumerate(prompts)
        for j in range(samples)
    ]
    with torch.inference_mode():
        batch.admit(seqs)
        while len(batch):
            batch.step()


def _seeded_draws(rows: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(before, now): `rows` seeded rows' uniforms for one decode step."""
    generators = [torch.Generator().manual_seed(7 * i) for i in range(rows)]
    seed_B = torch.tensor([sampling.seed_as_int64(7 * i) for i in range(rows)])
    draw_B = torch.full((rows,), 30, dtype=torch.long)

    def before() -> torch.Tensor:
        u_B = torch.rand(rows, dtype=torch.float64)
        for row, gen in enumerate(generators):
            u_B[row] = torch.rand((), generator=gen, dtype=torch.float64)
        return u_B

    def now() -> torch.Tensor:
        return sampling.seeded_uniforms(seed_B, draw_B)

    return before, now


def seeded_uniforms_against_generators(rounds: int) -> None:
    """Part 4: every seeded row's uniform for one decode step, two ways."""
    for rows in (128, 256):
        before, now = _seeded_draws(rows)
        times: dict[str, list[float]] = {"before": [], "now": []}
        for r in range(rounds + 1):
            for name, fn in (("before", before), ("now", now)):
                start = time.perf_counter()
                for _ in range(100):
                    fn()
                if r:
                    times[name].append((time.perf_counter() - start) / 100)
        b, n = statistics.median(times["before"]), statistics.median(times["now"])
        print(
            f"part 4: {rows} seeded rows' uniforms: a generator a row {1e3 * b:.3f} ms, "
            f"seeded_uniforms {1e3 * n:.3f} ms a step: {b / n:.1f}x"
        )


def rounds_on_model(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    prompts = []
    for i in range(args.prompts):
        chat = [{"role": "user", "content": f"What is {3 + 7 * i % 27} + {11 + 5 * i % 19}?"}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    print(
        f"part 2: decode rounds of {Path(args.model).name} ({args.dtype}), {args.prompts} "
        f"prompts x {args.samples} rows, {args.new} new tokens, {args.threads} thread(s); "
        f"medians of {args.rounds} rounds, interleaved"
    )
    for seeded, old_draw in ((True, float64_cumsum_draw), (False, multinomial_draw)):
        times: dict[str, list[float]] = {"inverse_cdf": [], "before": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, draw in (("before", old_draw), ("inverse_cdf", None)):
                with draw_swapped(draw):
                    start = time.perf_counter()
                    one_round(model, tok, prompts, args.samples, args.new, seeded)
                    if r:
                        times[name].append(time.perf_counter() - start)
        before, now = statistics.median(times["before"]), statistics.median(times["inverse_cdf"])
        label = "seeded rows (float64 cumsum before)" if seeded else "unseeded (multinomial before)"
        print(
            f"  {label:38s} before {before:6.3f} s  now {now:6.3f} s  a round "
            f"{before / now:4.2f}x faster"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_model = Path.home() / ".cache/rollouts/models/smollm2-135m-instruct"
    parser.add_argument("--model", default=str(default_model))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--skip-model", action="store_true", help="parts 1, 3 and 4 only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draw_alone(args.rows, args.vocab, args.rounds)
    logprob_of_the_draw(args.rows, args.vocab, args.rounds)
    seeded_uniforms_against_generators(args.rounds)
    if args.skip_model:
        return
    if Path(args.model).exists():
        rounds_on_model(args)
    else:
        print(f"part 2 skipped: no model at {args.model} (rollouts models fetch ...)")


if __name__ == "__main__":
    main()
