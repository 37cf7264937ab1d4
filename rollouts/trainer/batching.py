"""Pure functions that turn ragged sequences into micro-batches under a token budget.

Two layouts, both exact (a sequence's logprobs never depend on its neighbours):
- "pad": sequences sorted longest first, cut into micro-batches whose padded size
  (rows x longest row) fits the budget; rows are right-padded, so under a causal mask a real token
  never sees a pad token and no attention mask is needed (the fast causal kernel runs).
- "pack": sequences placed first-fit-decreasing into one row per micro-batch, with position ids
  that restart at 0 per sequence; transformers turns restarting position ids into a
  block-diagonal mask, so packed sequences do not attend to each other.
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

    def __post_init__(self) -> None:
        assert len(self.indices) == len(self.places), f"{len(self.indices)=} != {len(self.places)=}"
        assert self.rows >= 1 and self.row_len >= 1, f"{self.rows=} {self.row_len=}"

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.row_len


def plan_padded(lengths: Sequence[int], token_budget: int) -> list[MicroBatchPlan]:
    """Length-bucketed, right-padded micro-batches: rows x max_len <= token_budget."""
    assert token_budget >= 1, f"{token_budget=}"
    assert all(n >= 1 for n in lengths), f"empty sequence in {list(lengths)=}"
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[MicroBatchPlan] = []
    group: list[int] = []
    for i in order:
        width = lengths[group[0]] if group else lengths[i]
        if group and (len(group) + 1) * width > token_budget:
            plans.append(_padded_plan(group, lengths))
            group = []
        group.append(i)
    if group:
        plans.append(_padded_plan(group, lengths))
    return plans


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
    """Micro-batches for sequences of `lengths` in `layout` ("pad" | "pack")."""
    assert layout in LAYOUTS, f"{layout=} not in {LAYOUTS}"
    if not lengths:
        return []
    if layout == "pad":
        return plan_padded(lengths, token_budget)
    return plan_packed(lengths, token_budget)


def padding_fraction(plans: Sequence[MicroBatchPlan], lengths: Sequence[int]) -> float:
    """Fraction of the computed token slots that hold padding (0 = no waste)."""
    total = sum(p.padded_tokens for p in plans)
    real = sum(lengths[i] for p in plans for i in p.indices)
    assert real <= total, f"{real=} > {total=}"
    return 0.0 if total == 0 else 1.0 - real / total


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchTensors:
    """The model inputs of one micro-batch and where each sequence's predictions sit."""

    input_ids_R_L: torch.Tensor
    position_ids_R_L: torch.Tensor | None  # None = the model's default arange
    pred_rows: torch.Tensor  # [N] row of the hidden state that predicts each target token
    pred_cols: torch.Tensor  # [N] its column; the target is at column + 1
    split_sizes: tuple[int, ...]  # N split per sequence: length - 1 each
    # [M] the predictions the LM head runs on (their targets are trained); None = all N
    head_idx: torch.Tensor | None = None


def build_tensors(
    plan: MicroBatchPlan,
    input_ids: Sequence[torch.Tensor],
    pad_id: int = 0,
    loss_mask: Sequence[torch.Tensor] | None = None,
) -> MicroBatchTensors:
    """Lay the plan's sequences out in rows; list the (row, col) of every next-token prediction.

    With `loss_mask` (one per sequence of `input_ids`), `head_idx` lists the predictions whose
    target is trained (mask != 0): the LM head runs only there (None when that is all of them).
    """
    ids = torch.full((plan.rows, plan.row_len), pad_id, dtype=torch.long)
    packed = plan.rows == 1 and len(plan.indices) > 1
    pos = torch.zeros((plan.rows, plan.row_len), dtype=torch.long) if packed else None
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    sizes: list[int] = []
    for i, (row, start) in zip(plan.indices, plan.places, strict=True):
        seq = input_ids[i]
        n = int(seq.shape[0])
        assert start + n <= plan.row_len, f"{start=} + {n=} > {plan.row_len=}"
        ids[row, start : start + n] = seq
        if pos is not None:
            pos[row, start : start + n] = torch.arange(n)
        rows.append(torch.full((n - 1,), row, dtype=torch.long))
        cols.append(torch.arange(start, start + n - 1, dtype=torch.long))
        sizes.append(n - 1)
    return MicroBatchTensors(
        input_ids_R_L=ids,
        position_ids_R_L=pos,
        pred_rows=torch.cat(rows),
        pred_cols=torch.cat(cols),
        split_sizes=tuple(sizes),
        head_idx=None if loss_mask is None else trained_predictions(plan, input_ids, loss_mask),
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
