"""Layout "prefix": micro-batches in which sequences that begin alike run their shared tokens once.

A GRPO group is n samples of one prompt: in the "pad" layout the decoder runs the prompt n times.
Here the sequences are grouped by their untrained head (the tokens before the first trained
target: the prompt) and each group's shared prefix (the longest common prefix of its members, at
most all but one token of the shortest) is a row of its own; every member's row holds only the
rest, at positions that continue the prefix, attending to it through the KV cache
(`model.TokenLogprobModel`). A prefix's states are exactly what each member's own forward would
compute, and its gradient is the sum over the members: the same loss as "pad", in fewer tokens.
The sequences in no such group (prompts of their own: SFT's conversations) are one more group
when they begin alike (a system message). Sequences in no group (or in one that shares too few
tokens to pay for it) are padded as in "pad".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollouts.trainer.batching import MicroBatchPlan, Row, cut_rows, plan_padded

# a group runs on its own prefix row only when that saves at least this many tokens
MIN_SHARED_TOKENS = 16


def untrained_head(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Tokens before the first trained target (at least 1: token 0 is never a target)."""
    assert input_ids.shape == loss_mask.shape, f"{input_ids.shape=} != {loss_mask.shape=}"
    trained = (loss_mask[1:] != 0).nonzero()
    return 1 + int(trained[0, 0]) if trained.numel() else int(input_ids.shape[0])


def shared_prefix_groups(
    input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor]
) -> list[tuple[int, list[int]]]:
    """(prefix length, members) of each set of >= 2 sequences with the same untrained head whose
    shared prefix saves at least MIN_SHARED_TOKENS; members in batch order."""
    assert len(input_ids) == len(loss_mask), f"{len(input_ids)=} != {len(loss_mask)=}"
    by_head: dict[bytes, list[int]] = {}
    for i, (ids, mask) in enumerate(zip(input_ids, loss_mask, strict=True)):
        head = ids[: untrained_head(ids, mask)].to(torch.int64)
        by_head.setdefault(head.numpy().tobytes(), []).append(i)
    groups = []
    for members in by_head.values():
        if len(members) >= 2 and (prefix_len := _common_prefix(input_ids, members)):
            groups.append((prefix_len, members))
    # the sequences left (prompts of their own: SFT's conversations, n = 1) share what they
    # begin with alike (a system message, the tools' description) as one more group
    grouped = {i for _, members in groups for i in members}
    rest = [i for i in range(len(input_ids)) if i not in grouped]
    if len(rest) >= 2 and (prefix_len := _common_prefix(input_ids, rest)):
        groups.append((prefix_len, rest))
    return groups


def _common_prefix(input_ids: Sequence[torch.Tensor], members: list[int]) -> int:
    """The longest prefix `members` share (each row keeps a token), or 0 when running it once
    saves fewer than MIN_SHARED_TOKENS."""
    common = min(int(input_ids[i].shape[0]) for i in members) - 1
    rows = torch.stack([input_ids[i][:common].to(torch.int64) for i in members])
    prefix_len = int((rows == rows[0]).all(0).to(torch.int64).cumprod(0).sum())
    return prefix_len if prefix_len * (len(members) - 1) >= MIN_SHARED_TOKENS else 0


def plan_shared_prefixes(
    input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor], token_budget: int
) -> list[MicroBatchPlan]:
    """Micro-batches of at most `token_budget` computed token slots (prefix rows included):
    the groups' members first, then the other sequences padded as in "pad". The members go in
    one of two orders, whichever `cut_rows` cuts cheaper: group by group (longest rests first;
    a group too large for one micro-batch runs its prefix again in the next), or all members
    longest rest first (few groups: a micro-batch of short rests runs each prefix once more,
    rather than padding them to a few long ones)."""
    assert token_budget >= 1, f"{token_budget=}"
    lengths = [int(x.shape[0]) for x in input_ids]
    assert all(n >= 1 for n in lengths), f"empty sequence in {lengths=}"
    groups = shared_prefix_groups(input_ids, loss_mask)
    grouped = {i for _, members in groups for i in members}

    def rest(prefix_len: int, i: int) -> int:
        return lengths[i] - prefix_len

    groups.sort(key=lambda g: (-max(rest(g[0], i) for i in g[1]), -g[0], g[1][0]))
    by_group = [
        (i, prefix_len, gid)
        for gid, (prefix_len, members) in enumerate(groups)
        for i in sorted(members, key=lambda i: (-rest(prefix_len, i), i))
    ]
    by_rest = sorted(by_group, key=lambda r: (-rest(r[1], r[0]), r[2], r[0]))
    best: tuple[int, list[list[tuple[int, int, int]]]] | None = None
    for order in (by_group, by_rest) if by_group else ():
        cuts, cost = cut_rows([Row(rest(p, i), p, g) for i, p, g in order], token_budget)
        if best is None or cost < best[0]:
            best = (cost, [[order[k] for k in cut] for cut in cuts])
    plans = [_prefix_plan(rows, lengths) for rows in best[1]] if best else []
    others = [i for i in range(len(lengths)) if i not in grouped]
    for plan in plan_padded([lengths[i] for i in others], token_budget) if others else []:
        plans.append(_remap(plan, others))
    return plans


def _prefix_plan(rows: list[tuple[int, int, int]], lengths: Sequence[int]) -> MicroBatchPlan:
    local: dict[int, int] = {}  # group id -> its prefix's index in this micro-batch
    prefix_lens: list[int] = []
    for _, p, gid in rows:
        if gid not in local:
            local[gid] = len(prefix_lens)
            prefix_lens.append(p)
    return MicroBatchPlan(
        indices=tuple(i for i, _, _ in rows),
        places=tuple((row, 0) for row in range(len(rows))),
        rows=len(rows),
        row_len=max(lengths[i] - p for i, p, _ in rows),
        prefix_lens=tuple(prefix_lens),
        prefix_of=tuple(local[gid] for _, _, gid in rows),
    )


def _remap(plan: MicroBatchPlan, positions: list[int]) -> MicroBatchPlan:
    """A plan over a subset (indices into `positions`) as a plan over the whole batch."""
    return MicroBatchPlan(
        indices=tuple(positions[k] for k in plan.indices),
        places=plan.places,
        rows=plan.rows,
        row_len=plan.row_len,
    )
