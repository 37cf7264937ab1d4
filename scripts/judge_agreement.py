"""How well an LLM judge grades, against a known ground truth: sums answered in free form.

    python scripts/judge_agreement.py MODEL_DIR [--pairs 40] [--template T] [--pattern P]

It serves MODEL_DIR with the built-in engine (fp32) and asks it, through the judge reward
(`rollouts/rollout/judge.py`, [judge]'s defaults unless given), to grade answers to "What is
a + b?" on held-out pairs that exact match cannot: the right sum or a wrong one (off by 1 to
10), each written as a numeral, in words ("forty-two") or in a sentence
(`rollouts/data/judge_sums.py`). Half are right. It prints
how many answers it parsed, the mean score of right and of wrong answers, the point-biserial
correlation of score with rightness, and the accuracy of "score >= 0.5" as a verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import trio

from rollouts.config.served import JudgeConfig
from rollouts.data.chat_sums import QUESTION
from rollouts.data.judge_sums import graded_answers
from rollouts.engine.launch import engine_server
from rollouts.inference.sglang import SGLangEngine
from rollouts.rewards.protocol import RewardUnparsed
from rollouts.rollout.judge import Judge, parse_score
from rollouts.trainer.building import load_tokenizer
from rollouts.types import Sample, Status


def graded(pairs: int, seed: int) -> list[tuple[Sample, bool]]:
    """Right and wrong free-form answers on held-out pairs, as finished samples."""
    out = []
    for i, (a, b, text, right) in enumerate(graded_answers(pairs, seed)):
        sample = Sample(
            index=i,
            group_index=0,
            prompt=({"role": "user", "content": QUESTION.format(a=a, b=b)},),
            label=a + b,
            status=Status.COMPLETED,
            metadata={"response_text": text},
        )
        out.append((sample, right))
    return out


async def run(args: argparse.Namespace) -> None:
    config = JudgeConfig(path=args.model, max_new_tokens=args.max_new_tokens)
    if args.template:
        config = dataclasses.replace(config, template=args.template)
    if args.pattern:
        config = dataclasses.replace(config, pattern=args.pattern)
    items = graded(args.pairs, args.seed)
    async with engine_server(Path(args.model), dtype="float32") as url:
        engine = SGLangEngine(url)
        judge = Judge(engines=engine, tokenizer=load_tokenizer(args.model), config=config)
        scores: list[float | None] = [None] * len(items)
        shown = 0

        async def one(k: int) -> None:
            nonlocal shown
            answer = await judge.answer(items[k][0])
            if shown < args.show:
                shown += 1
                print(f"  {items[k][0].metadata['response_text']!r} -> {answer!r}")
            try:
                scores[k] = parse_score(answer, config)
            except RewardUnparsed:
                scores[k] = None

        async with trio.open_nursery() as nursery:
            for k in range(len(items)):
                nursery.start_soon(one, k)
        await engine.aclose()
    parsed = [(s, right) for s, (_, right) in zip(scores, items, strict=True) if s is not None]
    print(f"parsed: {len(parsed)} of {len(items)} answers")
    if len(parsed) < 2:
        return
    right = [s for s, r in parsed if r]
    wrong = [s for s, r in parsed if not r]
    mean = statistics.fmean
    print(
        f"mean score: right {mean(right) if right else float('nan'):.3f} ({len(right)}), "
        f"wrong {mean(wrong) if wrong else float('nan'):.3f} ({len(wrong)})"
    )
    xs = [s for s, _ in parsed]
    ys = [1.0 if r else 0.0 for _, r in parsed]
    if statistics.pstdev(xs) > 0 and statistics.pstdev(ys) > 0:
        print(f"correlation of score with rightness: {statistics.correlation(xs, ys):.3f}")
    else:
        print("correlation: undefined (every score, or every answer's rightness, the same)")
    agree = sum((s >= 0.5) == r for s, r in parsed) / len(parsed)
    print(f"verdict (score >= 0.5) agrees with the truth: {agree:.3f} of the parsed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--template", default="")
    parser.add_argument("--pattern", default="")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--show", type=int, default=6, help="answers printed in full")
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
