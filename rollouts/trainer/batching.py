"""Pure functions that turn ragged sequences into micro-batches under a token budget.

Three layouts, all exact (a sequence's logprobs never depend on its neighbours):
- "pad": sequences sorted longest first, cut into micro-batches whose padded size
  (rows x longest row) fits the budget; rows are right-padded, so under a causal mask a real token
  never sees a pad token and no attention mask is needed (the fast causal kernel runs).
- "pack": sequences placed first-fit-decreasing into one row per micro-batch, with position ids
  that restart at 0 per sequence; transformers turns restarting position ids into a
  block-diagonal mask, so packed sequences do not attend to each other.
- "prefix": sequences that begin with the same tokens (a GRPO group's prompt) run those tokens
  once; the rows hold only what follows, attending to the shared prefix through the KV cache
  (`prefix_plan.py`). The others are padded as in "pad".
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

import torch

from rollouts.config.training import MicroBatchLayout

LAYOUTS = typing.get_args(MicroBatchLayout)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchPlan:
    """Which sequences go in one micro-batch, and where each sits: (row, start) per sequence."""

    indices: tuple[int, ...]  # positions in the batch
    places: tuple[tuple[int, int], ...]  # (row, start column) of each sequence
    rows: int
    row_len: int
    # layout "prefix": sequence k continues shared prefix `prefix_of[k]`, the first
    # `prefix_lens[g]` tokens of that prefix's first sequence; its row holds the rest of it.
    # Empty: no shared prefixes (each row holds its whole sequence)
    prefix_lens: tuple[int, ...] = ()
    prefix_of: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.indices) == len(self.places), f"{len(self.indices)=} != {len(self.places)=}"
        assert self.rows >= 1 and self.row_len >= 1, f"{self.rows=} {self.row_len=}"
        if self.prefix_lens:
            assert len(self.prefix_of) == len(self.indices), f"{self.prefix_of=} {self.indices=}"
            assert set(self.prefix_of) == set(range(len(self.prefix_lens))), f"{self.prefix_of=}"
            assert min(self.prefix_lens) >= 1, f"{self.prefix_lens=}"

    @property
    def padded_tokens(self) -> int:
        """Token slots the decoder computes (the shared prefixes' rows included)."""
        return self.rows * self.row_len + len(self.prefix_lens) * max(self.prefix_lens, default=0)

    def computed_tokens(self, lengths: Sequence[int]) -> int:
        """Real (not padding) token slots the decoder computes: a shared prefix counts once."""
        total = sum(lengths[i] for i in self.indices)
        if not self.prefix_lens:
            return total
        return total - sum(self.prefix_lens[g] for g in self.prefix_of) + sum(self.prefix_lens)


# What a micro-batch costs beyond its token slots (every layer's kernel launches, the backward's
# graph, the LM head's set-up), in token slots: `cut_rows` trades padding against micro-batches
# at this rate (`scripts/bench_micro_batch.py --cut` measures it)
MICRO_BATCH_COST_SLOTS = 64
# `cut_rows` looks at most this many rows back for a micro-batch's start: a bound on its work
# (rows x this) that only very short sequences under a large budget reach
MAX_ROWS_PER_MICRO_BATCH = 512


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One row of a micro-batch to be: its tokens, and the shared prefix it continues if any."""

    length: int  # the row's tokens (layout "prefix": the rest after its prefix)
    prefix_len: int = 0
    group: int = -1  # the shared prefix it continues; -1: none

    def __post_init__(self) -> None:
        assert self.length >= 1, f"{self.length=}"
        assert (self.group >= 0) == (self.prefix_len >= 1), f"{self.group=} {self.prefix_len=}"


def cut_rows(rows: Sequence[Row], token_budget: int) -> tuple[list[range], int]:
    """The cheapest cut of `rows`, in their order, into micro-batches of consecutive rows, and its
    cost: the token slots computed (rows x the longest row, plus a row per shared prefix held x
    the longest prefix) + MICRO_BATCH_COST_SLOTS per micro-batch. Each fits `token_budget`
    (a row alone may not). Dynamic programming: cutting a sorted batch greedily at the budget
    pads a few long rows' short neighbours to their length (a third of the slots of an agent
    batch whose few long episodes lead a run of short ones)."""
    assert token_budget >= 1, f"{token_budget=}"
    n = len(rows)
    best = [0] + [-1] * n  # best[j]: the cheapest cost of rows[:j]
    start = [0] * (n + 1)  # where the last micro-batch of that cut starts
    for j in range(1, n + 1):
        longest = longest_prefix = 0
        groups: set[int] = set()
        for i in range(j - 1, max(-1, j - 1 - MAX_ROWS_PER_MICRO_BATCH), -1):
            row = rows[i]
            longest = max(longest, row.length)
            if row.group >= 0:
                groups.add(row.group)
                longest_prefix = max(longest_prefix, row.prefix_len)
            slots = (j - i) * longest + len(groups) * longest_prefix
            if slots > token_budget and i < j - 1:
                break  # slots only grow as the micro-batch reaches further back
            cost = best[i] + slots + MICRO_BATCH_COST_SLOTS
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, i
    cuts: list[range] = []
    j = n
    while j > 0:
        cuts.append(range(start[j], j))
        j = start[j]
    cuts.reverse()
    assert sum(len(c) for c in cuts) == n, f"{cuts=} {n=}"
    return cuts, best[n]


def plan_padded(lengths: Sequence[int], token_budget: int) -> list[MicroBatchPlan]:
    """Length-bucketed, right-padded micro-batches: rows x max_len <= token_budget; sorted longest
    first and cut where it pads least (`cut_rows`)."""
    assert token_budget >= 1, f"{token_budget=}"
    assert all(n >= 1 for n in lengths), f"empty sequence in {list(lengths)=}"
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cuts, _ = cut_rows([Row(lengths[i]) for i in order], token_budget)
    return [_padded_plan([order[k] for k in cut], lengths) for cut in cuts]


def _padded_plan(group: list[int], lengths: Sequence[int]) -> MicroBatchPlan:
    return MicroBatchPlan(
        indices=tuple(group),
        places=tuple((row, 0) for row in range(len(group))),
        rows=len(group),
        row_len=max(lengths[i] for i in group),
    )


def plan_packed(lengths: Sequence[int], token_budget: int) -> list[MicroBatchPlan]:
    """First-fit-decreasing bins of at most `token_budget` tokens, one row per micro-batch."""
    assert token_budget >= 1, f"{token_budget=}"
    assert all(n >= 1 for n in lengths), f"empty sequence in {list(lengths)=}"
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b, fill in enumerate(used):
            if fill + lengths[i] <= token_budget:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    plans = []
    for members, fill in zip(bins, used, strict=True):
        starts = [sum(lengths[j] for j in members[:k]) for k in range(len(members))]
        places = tuple((0, s) for s in starts)
        plans.append(MicroBatchPlan(indices=tuple(members), places=places, rows=1, row_len=fill))
    return plans


def plan_micro_batches(
    lengths: Sequence[int], token_budget: int, layout: str
) -> list[MicroBatchPlan]:
    """Micro-batches for sequences of `lengths` in `layout` ("pad" | "pack"; "prefix" reads
    the tokens: `prefix_plan.plan_shared_prefixes`)."""
    assert layout in ("pad", "pack"), f"{layout=} not in ('pad', 'pack')"
    if not lengths:
        return []
    if layout == "pad":
        return plan_padded(lengths, token_budget)
    return plan_packed(lengths, token_budget)


def padding_fraction(plans: Sequence[MicroBatchPlan], lengths: Sequence[int]) -> float:
    """Fraction of the computed token slots that hold padding (0 = no waste)."""
    total = sum(p.padded_tokens for p in plans)
    real = sum(p.computed_tokens(lengths) for p in plans)
    assert real <= total, f"{real=} > {total=}"
    return 0.0 if total == 0 else 1.0 - real / total


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedPrefix:
    """Layout "prefix": prefixes the decoder runs once, each continued by one or more rows."""

    ids_G_P: torch.Tensor  # the shared prefixes, right-padded
    row_prefix_R: torch.Tensor  # [R] the prefix each row of `input_ids_R_L` continues
    attention_mask_R_K: torch.Tensor  # [R, P + L]: 0 on the padding of each row's prefix


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchTensors:
    """The model inputs of one micro-batch and where each sequence's predictions sit."""

    input_ids_R_L: torch.Tensor
    position_ids_R_L: torch.Tensor | None  # None = the model's default arange
    # [N] each next-token prediction's hidden state, as an index into the decoder's states
    # flattened to [tokens, hidden] (the shared prefixes' rows first, then the rows)
    pred_idx: torch.Tensor
    targets: torch.Tensor  # [N] the token each prediction is scored on
    split_sizes: tuple[int, ...]  # N split per sequence: length - 1 each
    # [M] the predictions the LM head runs on (their targets are trained); None = all N
    head_idx: torch.Tensor | None = None
    prefix: SharedPrefix | None = None  # layout "prefix": the rows continue these
    # [N, K] top-k distillation: K more tokens each prediction is scored on (the teacher's)
    top_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.pred_idx.shape == self.targets.shape, f"{self.pred_idx.shape=}"
        assert self.pred_idx.shape[0] == sum(self.split_sizes), f"{self.split_sizes=}"
        assert self.top_ids is None or self.top_ids.shape[0] == self.targets.shape[0]


def build_tensors(
    plan: MicroBatchPlan,
    input_ids: Sequence[torch.Tensor],
    pad_id: int = 0,
    loss_mask: Sequence[torch.Tensor] | None = None,
    top_ids: Sequence[torch.Tensor] = (),
) -> MicroBatchTensors:
    """Lay the plan's sequences out in rows; list the hidden state and target of every
    next-token prediction.

    With `loss_mask` (one per sequence of `input_ids`), `head_idx` lists the predictions whose
    target is trained (mask != 0): the LM head runs only there (None when that is all of them).
    With `top_ids` ([T_i, K] per sequence), each prediction is also scored on its row's K tokens.
    """
    head_idx = None if loss_mask is None else trained_predictions(plan, input_ids, loss_mask)
    mb = _laid_out(plan, input_ids, pad_id, head_idx)
    if not top_ids:
        return mb
    # predictions are listed sequence by sequence, in plan order, in every layout
    top = torch.cat([top_ids[i][1:] for i in plan.indices])
    return dataclasses.replace(mb, top_ids=top)


def _laid_out(
    plan: MicroBatchPlan,
    input_ids: Sequence[torch.Tensor],
    pad_id: int,
    head_idx: torch.Tensor | None,
) -> MicroBatchTensors:
    if plan.prefix_lens:
        return _prefixed_tensors(plan, input_ids, pad_id, head_idx)
    ids = torch.full((plan.rows, plan.row_len), pad_id, dtype=torch.long)
    packed = plan.rows == 1 and len(plan.indices) > 1
    pos = torch.zeros((plan.rows, plan.row_len), dtype=torch.long) if packed else None
    where: list[torch.Tensor] = []
    sizes: list[int] = []
    for i, (row, start) in zip(plan.indices, plan.places, strict=True):
        seq = input_ids[i]
        n = int(seq.shape[0])
        assert start + n <= plan.row_len, f"{start=} + {n=} > {plan.row_len=}"
        ids[row, start : start + n] = seq
        if pos is not None:
            pos[row, start : start + n] = torch.arange(n)
        where.append(row * plan.row_len + torch.arange(start, start + n - 1, dtype=torch.long))
        sizes.append(n - 1)
    pred_idx = torch.cat(where)
    return MicroBatchTensors(
        input_ids_R_L=ids,
        position_ids_R_L=pos,
        pred_idx=pred_idx,
        targets=ids.flatten()[pred_idx + 1],
        split_sizes=tuple(sizes),
        head_idx=head_idx,
    )


def _prefixed_tensors(
    plan: MicroBatchPlan,
    input_ids: Sequence[torch.Tensor],
    pad_id: int,
    head_idx: torch.Tensor | None,
) -> MicroBatchTensors:
    """Tensors of a "prefix" plan: the prefixes [G, P] (the states of their tokens come first),
    then each row: the rest of its sequence, at positions that continue its prefix."""
    num_prefixes, prefix_len = len(plan.prefix_lens), max(plan.prefix_lens)
    prefix_ids = torch.full((num_prefixes, prefix_len), pad_id, dtype=torch.long)
    first = {g: i for i, g in reversed(list(zip(plan.indices, plan.prefix_of, strict=True)))}
    for g, p in enumerate(plan.prefix_lens):
        prefix_ids[g, :p] = input_ids[first[g]][:p]
    ids = torch.full((plan.rows, plan.row_len), pad_id, dtype=torch.long)
    pos = torch.zeros((plan.rows, plan.row_len), dtype=torch.long)
    mask = torch.ones((plan.rows, prefix_len + plan.row_len), dtype=torch.long)
    where: list[torch.Tensor] = []
    sizes: list[int] = []
    row_prefix = torch.zeros(plan.rows, dtype=torch.long)
    row_base = num_prefixes * prefix_len  # the rows' states follow the prefixes'
    for i, (row, _), g in zip(plan.indices, plan.places, plan.prefix_of, strict=True):
        seq, p = input_ids[i], plan.prefix_lens[g]
        n = int(seq.shape[0])
        assert p < n <= p + plan.row_len, f"{p=} {n=} {plan.row_len=}"
        assert torch.equal(seq[:p], prefix_ids[g, :p]), (
            f"sequence {i} does not begin with prefix {g}"
        )
        ids[row, : n - p] = seq[p:]
        pos[row] = p + torch.arange(plan.row_len)
        mask[row, p:prefix_len] = 0
        row_prefix[row] = g
        # predictions 0..p-1 come from the prefix's states, p..n-2 from the row's
        in_prefix = g * prefix_len + torch.arange(p, dtype=torch.long)
        in_row = row_base + row * plan.row_len + torch.arange(n - 1 - p, dtype=torch.long)
        where += [in_prefix, in_row]
        sizes.append(n - 1)
    targets = torch.cat([input_ids[i][1:] for i in plan.indices])
    prefix = SharedPrefix(
        ids_G_P=prefix_ids,
        row_prefix_R=row_prefix,
        attention_mask_R_K=mask,
    )
    return MicroBatchTensors(
        input_ids_R_L=ids,
        position_ids_R_L=pos,
        pred_idx=torch.cat(where),
        targets=targets,
        split_sizes=tuple(sizes),
        head_idx=head_idx,
        prefix=prefix,
    )


def trained_predictions(
    plan: MicroBatchPlan, input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """Indices, into the plan's flat predictions, of those whose target token is trained;
    None when every prediction is (nothing to skip)."""
    assert len(loss_mask) == len(input_ids), f"{len(loss_mask)=} != {len(input_ids)=}"
    # prediction k of a sequence targets its token k + 1: drop each mask's position 0
    trained = torch.cat([loss_mask[i][1:] != 0 for i in plan.indices])
    assert trained.shape[0] == sum(int(input_ids[i].shape[0]) - 1 for i in plan.indices)
    if bool(trained.all()):
        return None
    return trained.nonzero().squeeze(-1)


def shard_indices(lengths: Sequence[int], world_size: int, rank: int) -> list[int]:
    """The sequences rank `rank` trains on: longest first to the least-loaded rank (by tokens)."""
    assert 0 <= rank < world_size, f"{rank=} {world_size=}"
    loads = [0] * world_size
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]
