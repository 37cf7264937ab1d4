"""DataBuffer: the one stateful component between the dataset and the rollout manager.

It serves prompts in a deterministic per-epoch shuffled order (the permutation of
`np.random.default_rng([seed, epoch])`: seed and epoch as two entropy words, so seed 1 epoch 0
and seed 0 epoch 1 differ), crosses epoch boundaries without a gap, and keeps a pool of partial
(aborted) groups that are served before fresh prompts. `state_dict()` holds everything needed
for a resumed run to see exactly the same order, partial groups included.

A mixture (`DataBuffer.mixture`) interleaves several sources: draw k comes from the source
`np.random.default_rng([seed, MIX_STREAM, k])` picks by weight, and each source goes through its
own epochs (its own permutation per epoch, `[seed, epoch, MIX_STREAM, i]`). Both depend on the
counters alone, so the state is those counters and a resumed run draws the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollouts.types import PromptItem, Sample, sample_from_dict, sample_to_dict

STATE_VERSION = 1
MIX_STREAM = 0x6D6978  # "mix": an entropy word apart from the single dataset's [seed, epoch]


def epoch_order(
    num_items: int, epoch: int, seed: int, shuffle: bool, stream: tuple[int, ...] = ()
) -> list[int]:
    """The order of dataset indices in `epoch`: a seeded permutation, or 0..n-1. `stream`
    (a mixture's source) adds entropy words, so each source has its own permutations."""
    assert num_items > 0, f"{num_items=} must be > 0"
    assert epoch >= 0, f"{epoch=} must be >= 0"
    if not shuffle:
        return list(range(num_items))
    rng = np.random.default_rng([seed, epoch, *stream])
    return rng.permutation(num_items).tolist()


def mixture_pick(draw: int, seed: int, cumulative: Sequence[float]) -> int:
    """The source of draw number `draw`: by weight (`cumulative`: the running sums of the
    weights, normalized to end at 1), from the seed and the draw number alone."""
    assert draw >= 0, f"{draw=} must be >= 0"
    u = np.random.default_rng([seed, MIX_STREAM, draw]).random()
    return min(int(np.searchsorted(cumulative, u, side="right")), len(cumulative) - 1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MixtureSource:
    """One source of a mixture: its name (in metrics and checkpoints), prompts and weight."""

    name: str
    items: tuple[PromptItem, ...]
    weight: float

    def __post_init__(self) -> None:
        assert self.items, f"source {self.name!r} has no prompt"
        assert self.weight > 0, f"source {self.name!r}: {self.weight=} must be > 0"


class _SourceOrder:
    """A source's place in its own epochs (what a single-dataset buffer keeps for its one)."""

    def __init__(self, num_items: int, seed: int, shuffle: bool, stream: tuple[int, ...]):
        self.num_items = num_items
        self._key = (seed, shuffle, stream)
        self.epoch_id = 0
        self.sample_offset = 0
        self.drawn = 0
        self._order = epoch_order(num_items, 0, seed, shuffle, stream)

    def take(self, n: int) -> list[int]:
        """The next `n` indices, crossing into the next epoch (reshuffled) as needed."""
        seed, shuffle, stream = self._key
        out: list[int] = []
        while len(out) < n:
            if self.sample_offset == len(self._order):
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = epoch_order(self.num_items, self.epoch_id, seed, shuffle, stream)
            take = min(n - len(out), len(self._order) - self.sample_offset)
            out += self._order[self.sample_offset : self.sample_offset + take]
            self.sample_offset += take
        self.drawn += n
        return out

    def restore(self, epoch_id: int, sample_offset: int, drawn: int) -> None:
        seed, shuffle, stream = self._key
        self.epoch_id, self.sample_offset, self.drawn = epoch_id, sample_offset, drawn
        self._order = epoch_order(self.num_items, epoch_id, seed, shuffle, stream)


class DataBuffer:
    """Prompts in a reproducible order, plus the pool of partial groups to resume first."""

    def __init__(self, items: Sequence[PromptItem], seed: int = 0, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("DataBuffer needs at least one prompt")
        self._items = list(items)
        self._seed = seed
        self._shuffle = shuffle
        self.total_served = 0
        self._next_group_index = 0
        self._partial: list[tuple[Sample, ...]] = []
        # one source: the dataset (its order as before mixtures); a mixture's: one per source
        self._names: tuple[str, ...] = ()
        self._starts = [0]
        self._orders = [_SourceOrder(len(self._items), seed, shuffle, ())]
        self._cumulative: list[float] = [1.0]

    @classmethod
    def mixture(
        cls, sources: Sequence[MixtureSource], seed: int = 0, shuffle: bool = True
    ) -> DataBuffer:
        """A buffer drawing from several sources by weight, each through its own epochs."""
        assert sources, "a mixture needs at least one source"
        buffer = cls([item for s in sources for item in s.items], seed, shuffle)
        buffer._names = tuple(s.name for s in sources)
        buffer._starts = np.cumsum([0] + [len(s.items) for s in sources[:-1]]).tolist()
        buffer._orders = [
            _SourceOrder(len(s.items), seed, shuffle, (MIX_STREAM, i))
            for i, s in enumerate(sources)
        ]
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        buffer._cumulative = (np.cumsum(weights) / weights.sum()).tolist()
        return buffer

    def __len__(self) -> int:
        return len(self._items)

    @property
    def epoch_id(self) -> int:
        """The epoch of a single dataset (of a mixture: its first source's)."""
        return self._orders[0].epoch_id

    @property
    def sample_offset(self) -> int:
        """The place in that epoch's order."""
        return self._orders[0].sample_offset

    @property
    def num_partial_groups(self) -> int:
        return len(self._partial)

    def get_prompts(self, n: int) -> list[PromptItem]:
        """The next `n` prompts in order, crossing into the next epoch (reshuffled) as needed;
        of a mixture, each drawn from the source its draw number picks."""
        assert n >= 0, f"{n=} must be >= 0"
        if not self._names:
            out = [self._items[i] for i in self._orders[0].take(n)]
        else:
            out = []
            for draw in range(self.total_served, self.total_served + n):
                k = mixture_pick(draw, self._seed, self._cumulative)
                out.append(self._items[self._starts[k] + self._orders[k].take(1)[0]])
        self.total_served += n
        return out

    def source_metrics(self) -> dict[str, float]:
        """A mixture's per-source counters: `source/<name>/drawn` (prompts drawn so far) and
        `source/<name>/epoch`; nothing for a single dataset."""
        out: dict[str, float] = {}
        if not self._names:
            return out
        for name, order in zip(self._names, self._orders, strict=True):
            out[f"source/{name}/drawn"] = float(order.drawn)
            out[f"source/{name}/epoch"] = float(order.epoch_id)
        return out

    def add_partial_groups(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Keep aborted groups to resume first in a later batch."""
        for group in groups:
            assert group, "an empty group cannot be kept"
            self._partial.append(tuple(group))

    def drop_partial_groups(self, is_dropped: Callable[[tuple[Sample, ...]], bool]) -> int:
        """Remove the partial groups `is_dropped` selects (e.g. too stale); returns how many."""
        before = len(self._partial)
        self._partial = [g for g in self._partial if not is_dropped(g)]
        return before - len(self._partial)

    def get_groups(self, num_groups: int, n_samples_per_prompt: int) -> list[tuple[Sample, ...]]:
        """`num_groups` groups: partial ones first, then fresh prompts as PENDING samples."""
        assert num_groups >= 0, f"{num_groups=} must be >= 0"
        assert n_samples_per_prompt >= 1, f"{n_samples_per_prompt=} must be >= 1"
        groups = self._partial[:num_groups]
        self._partial = self._partial[num_groups:]
        for item in self.get_prompts(num_groups - len(groups)):
            group_index = self._next_group_index
            self._next_group_index += 1
            groups.append(
                tuple(
                    Sample(
                        index=item.index,
                        group_index=group_index,
                        prompt=item.prompt,
                        label=item.label,
                        metadata=dict(item.metadata),
                    )
                    for _ in range(n_samples_per_prompt)
                )
            )
        return groups

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same order (JSON-safe)."""
        first = self._orders[0]
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "num_items": len(self._items),
            "seed": self._seed,
            "shuffle": self._shuffle,
            "epoch_id": first.epoch_id,
            "sample_offset": first.sample_offset,
            "total_served": self.total_served,
            "next_group_index": self._next_group_index,
            "partial_groups": [[sample_to_dict(s) for s in g] for g in self._partial],
        }
        if self._names:
            state["sources"] = [
                {
                    "name": name,
                    "num_items": order.num_items,
                    "epoch_id": order.epoch_id,
                    "sample_offset": order.sample_offset,
                    "drawn": order.drawn,
                }
                for name, order in zip(self._names, self._orders, strict=True)
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the dataset (each source of a mixture) must be the same
        size as when it was saved."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"DataBuffer state version {state.get('version')} != {STATE_VERSION}")
        self._check_sources(state.get("sources"))
        if state["num_items"] != len(self._items):
            raise ValueError(
                f"DataBuffer state was saved with {state['num_items']} prompts but the dataset "
                f"has {len(self._items)}: resume with the same dataset file"
            )
        self._seed = state["seed"]
        self._shuffle = state["shuffle"]
        self.total_served = state["total_served"]
        self._next_group_index = state["next_group_index"]
        rows = state.get("sources") or [
            {"epoch_id": state["epoch_id"], "sample_offset": state["sample_offset"], "drawn": 0}
        ]
        for i, (order, row) in enumerate(zip(self._orders, rows, strict=True)):
            order._key = (self._seed, self._shuffle, (MIX_STREAM, i) if self._names else ())
            drawn = row["drawn"] if self._names else self.total_served
            order.restore(row["epoch_id"], row["sample_offset"], drawn)
        self._partial = [tuple(sample_from_dict(s) for s in g) for g in state["partial_groups"]]

    def _check_sources(self, saved: list[dict[str, Any]] | None) -> None:
        """A mixture resumes only into the same sources, of the same sizes, in the same order."""
        names = zip(self._names, self._orders, strict=True) if self._names else ()
        now = [(name, o.num_items) for name, o in names]
        then = [(row["name"], row["num_items"]) for row in saved or []]
        if now != then:
            describe = lambda pairs: ", ".join(f"{n} ({k} prompts)" for n, k in pairs) or "none"  # noqa: E731
            raise ValueError(
                f"DataBuffer state was saved with the sources [{describe(then)}] but the run "
                f"has [{describe(now)}]: resume with the same [[data.sources]] and datasets"
            )
