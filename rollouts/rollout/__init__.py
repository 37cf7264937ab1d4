"""Rollout generation: the AsyncRolloutManager, pure batch functions, filters, the agent loop.

Layout: `protocol` (GenerateFn, GenerateContext, GroupFilter), `generate` (default single-turn
generate fn and partial-resume helpers), `agent` (multi-turn token-in-token-out loop),
`trajectory` (incremental rendering, trajectory_to_sample), `filters`, `planning` (pure
over-sampling and staleness decisions), `batch` (pure batch building), `manager` (the trio
wiring).
"""

from rollouts.rollout.agent import generate_multi_turn
from rollouts.rollout.batch import (
    ShortBatchError,
    build_batch_metadata,
    compute_response_lengths,
    convert_to_batch,
)
from rollouts.rollout.filters import (
    check_min_reward,
    check_quality_and_diversity,
    check_reasonable_length,
    check_response_diversity,
    check_reward_nonzero_std,
    resolve_filters,
)
from rollouts.rollout.generate import generate_single_turn, sampling_params_from_config
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.rollout.planning import is_fresh_enough, sample_staleness, split_stale_groups
from rollouts.rollout.protocol import FilterResult, GenerateContext, GenerateFn, GroupFilter
from rollouts.rollout.trajectory import trajectory_to_sample

__all__ = [
    "AsyncRolloutManager",
    "FilterResult",
    "GenerateContext",
    "GenerateFn",
    "GroupFilter",
    "ShortBatchError",
    "build_batch_metadata",
    "check_min_reward",
    "check_quality_and_diversity",
    "check_reasonable_length",
    "check_response_diversity",
    "check_reward_nonzero_std",
    "compute_response_lengths",
    "convert_to_batch",
    "generate_multi_turn",
    "generate_single_turn",
    "is_fresh_enough",
    "resolve_filters",
    "sample_staleness",
    "sampling_params_from_config",
    "split_stale_groups",
    "trajectory_to_sample",
]
