"""DataBuffer: the one stateful component between the dataset and the rollout manager.

It serves prompts in a deterministic per-epoch shuffled order (the permutation of
`np.random.default_rng([seed, epoch])`: seed and epoch as two entropy words, so seed 1 epoch 0
and seed 0 epoch 1 differ), crosses epoch boundaries without a gap, and keeps a pool of partial
(aborted) groups that are served before fresh prompts. `state_dict()` holds everything needed
for a resumed run to see exactly the same order, partial groups included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollouts.types import PromptItem, Sample, sample_from_dict, sample_to_dict

STATE_VERSION = 1


def epoch_order(num_items: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of dataset indices in `epoch`: a seeded permutation, or 0..n-1."""
    assert num_items > 0, f"{num_items=} must be > 0"
    assert epoch >= 0, f"{epoch=} must be >= 0"
    if not shuffle:
        return list(range(num_items))
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_items).tolist()


class DataBuffer:
    """Prompts in a reproducible order, plus the pool of partial groups to resume first."""

    def __init__(self, items: Sequence[PromptItem], seed: int = 0, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("DataBuffer needs at least one prompt")
        self._items = list(items)
        self._seed = seed
        self._shuffle = shuffle
        self.epoch_id = 0
        self.sample_offset = 0  # position inside the current epoch's order
        self.total_served = 0
        self._next_group_index = 0
        self._order = epoch_order(len(self._items), 0, seed, shuffle)
        self._partial: list[tuple[Sample, ...]] = []

    def __len__(self) -> int:
        return len(self._items)

    def _epoch_order(self) -> list[int]:
        return epoch_order(len(self._items), self.epoch_id, self._seed, self._shuffle)

    @property
    def num_partial_groups(self) -> int:
        return len(self._partial)

    def get_prompts(self, n: int) -> list[PromptItem]:
        """The next `n` prompts in order, crossing into the next epoch (reshuffled) as needed."""
        assert n >= 0, f"{n=} must be >= 0"
        out: list[PromptItem] = []
        while len(out) < n:
            if self.sample_offset == len(self._order):
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = epoch_order(
                    len(self._items), self.epoch_id, self._seed, self._shuffle
                )
            take = min(n - len(out), len(self._order) - self.sample_offset)
            chunk = self._order[self.sample_offset : self.sample_offset + take]
            out.extend(self._items[i] for i in chunk)
            self.sample_offset += take
        self.total_served += n
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
        return {
            "version": STATE_VERSION,
            "num_items": len(self._items),
            "seed": self._seed,
            "shuffle": self._shuffle,
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "total_served": self.total_served,
            "next_group_index": self._next_group_index,
            "partial_groups": [[sample_to_dict(s) for s in g] for g in self._partial],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the dataset must be the same size as when it was saved."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"DataBuffer state version {state.get('version')} != {STATE_VERSION}")
        if state["num_items"] != len(self._items):
            raise ValueError(
                f"DataBuffer state was saved with {state['num_items']} prompts but the dataset "
                f"has {len(self._items)}: resume with the same dataset file"
            )
        self._seed = state["seed"]
        self._shuffle = state["shuffle"]
        self.epoch_id = state["epoch_id"]
        self.sample_offset = state["sample_offset"]
        self.total_served = state["total_served"]
        self._next_group_index = state["next_group_index"]
        self._order = self._epoch_order()
        self._partial = [tuple(sample_from_dict(s) for s in g) for g in state["partial_groups"]]
