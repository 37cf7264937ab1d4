"""Protocols of user reward functions (per sample, after collection)."""

from __future__ import annotations

from typing import Protocol

from rollouts.types import Reward, Sample


class RewardFn(Protocol):
    """Score one finished sample: a float, or a tuple of floats (vector reward).

    Sync or async. A reward function that raises (or times out) marks the sample FAILED; it is
    never turned into a reward of 0.
    """

    def __call__(self, sample: Sample) -> Reward: ...
