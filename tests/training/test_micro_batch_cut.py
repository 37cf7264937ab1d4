"""`batching.cut_rows`: micro-batches cut where they cost least, not greedily at the budget."""

from __future__ import annotations

import itertools
import random

import torch

from rollouts.trainer import batching
from rollouts.trainer.batching import Row, cut_rows, plan_padded
from rollouts.trainer.prefix_plan import plan_shared_prefixes


def brute_force(rows: list[Row], budget: int) -> int:
    """The cheapest cost over every cut of `rows` into consecutive micro-batches."""
    best = None
    n = len(rows)
    for bits in itertools.product((0, 1), repeat=n - 1):
        starts = [0, *(k + 1 for k, b in enumerate(bits) if b), n]
        cost = 0
        for a, b in itertools.pairwise(starts):
            part = rows[a:b]
            groups = {r.group for r in part if r.group >= 0}
            prefix = max((r.prefix_len for r in part), default=0)
            slots = len(part) * max(r.length for r in part) + len(groups) * prefix
            if slots > budget and len(part) > 1:
                break
            cost += slots + batching.MICRO_BATCH_COST_SLOTS
        else:
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


def test_the_cut_is_the_cheapest_there_is() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        rows = []
        for _ in range(n):
            group = rng.choice((-1, 0, 1))
            rows.append(Row(rng.randint(1, 60), rng.randint(1, 30) if group >= 0 else 0, group))
        budget = rng.randint(20, 300)
        cuts, cost = cut_rows(rows, budget)
        assert cost == brute_force(rows, budget), (rows, budget, cuts)
        assert [k for cut in cuts for k in cut] == list(range(n))


def test_a_few_long_sequences_do_not_pad_the_short_ones() -> None:
    # the shop agent's batch: a long shared prompt, 16 episodes a group, a few of them long
    rng = random.Random(1)
    ids, masks = [], []
    for _ in range(2):
        head = torch.randint(3, 40, (280,), generator=torch.Generator().manual_seed(len(ids)))
        for _ in range(16):
            rest = rng.randint(90, 140) if rng.random() < 0.25 else rng.randint(32, 60)
            ids.append(torch.cat([head, torch.randint(3, 40, (rest,))]))
            masks.append(torch.cat([torch.zeros(280), torch.ones(rest)]))
    lengths = [int(x.shape[0]) for x in ids]
    plans = plan_shared_prefixes(ids, masks, 2048)
    assert sorted(i for p in plans for i in p.indices) == list(range(len(ids)))
    slots = sum(p.padded_tokens for p in plans)
    real = sum(p.computed_tokens(lengths) for p in plans)
    # cut greedily at the budget, longest rests first, the slots were 1.44x the real tokens
    assert slots < 1.2 * real, (slots, real, [(p.rows, p.row_len) for p in plans])
    assert all(p.padded_tokens <= 2048 for p in plans)


def test_padded_plans_fit_the_budget_and_hold_every_sequence_once() -> None:
    rng = random.Random(2)
    lengths = [rng.randint(1, 700) for _ in range(300)] + [3000]
    plans = plan_padded(lengths, 2048)
    assert sorted(i for p in plans for i in p.indices) == list(range(len(lengths)))
    for p in plans:
        assert p.row_len == max(lengths[i] for i in p.indices)
        assert p.padded_tokens <= 2048 or p.rows == 1
