"""A reward for plumbing tests on the real model: it always varies within a group.

Two RL steps of a weak model against exact match often score every sample 0, so every advantage
is 0 and nothing trains. This reward (the exact-match score plus a small term for each distinct
character) gives different samples different rewards, so the steps really update the weights.
"""

from __future__ import annotations

from rollouts.rewards.verifiers import exact_match_reward
from rollouts.types import Sample


def varied_reward(sample: Sample) -> float:
    """exact match (0 or 1) + 0.01 per distinct character of the response."""
    text = sample.metadata["response_text"]
    return exact_match_reward(sample) + 0.01 * len(set(text))
