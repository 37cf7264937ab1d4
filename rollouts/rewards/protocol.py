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


class RewardUnparsed(ValueError):
    """A reward that asks a model (an LLM judge) got an answer it cannot read a score from: the
    sample FAILED (`reward/unparsed`), never a 0."""


class RewardServiceUnavailable(RuntimeError):
    """The service a reward asks (a judge's engines) has no engine left: not the sample's
    fault; the batch is lost and the run stops, as when the policy's engines are gone."""
