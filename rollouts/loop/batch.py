"""Pure steps of the RL loop: groups of scored samples -> TrainBatch(es), and step metrics.

Nothing here does I/O or touches a model: the loop (`rl.py`) wires these together with the
rollout manager, the backend and the engines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollouts.algorithms.advantages import outcome_token_rewards, reverse_kl_per_token
from rollouts.algorithms.batch import build_train_batch, nest
from rollouts.algorithms.tensors import joined, long_views, mask_views
from rollouts.config import AlgorithmConfig
from rollouts.data.loaders import SOURCE_KEY
from rollouts.failures import failure_metrics
from rollouts.loop.episodes import episode_metrics
from rollouts.rewards.shaping import scored_reward
from rollouts.rollout.planning import split_stale_groups
from rollouts.rollout.signal import SIGNAL_KEY, group_signal, signal_counts, signal_metrics
from rollouts.types import RolloutBatch, Sample, Status, TrainBatch

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)
Group = tuple[Sample, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PreparedGroups:
    """Groups ready for advantages, and what was set aside on the way (with counts)."""

    groups: tuple[Group, ...]
    failed_samples: int
    stale_groups: int
    max_staleness_seen: int
    stale_tokens: int = 0  # the response tokens of the stale groups (thrown away)


def _version_int(version: str | None) -> int | None:
    try:
        return int(version) if version is not None else None
    except ValueError:
        return None


def prepare_groups(
    groups: Sequence[Sequence[Sample]], current_version: str, max_staleness: int | None
) -> PreparedGroups:
    """Drop samples that cannot be trained (FAILED, ABORTED) and groups past the staleness bound.

    `max_staleness=None` keeps every group.
    """
    failed = 0
    trainable: list[Group] = []
    for group in groups:
        keep = tuple(s for s in group if s.status in TRAINABLE)
        failed += len(group) - len(keep)
        if keep:
            trainable.append(keep)
    stale: list[Group] = []
    if max_staleness is not None:
        trainable, stale = split_stale_groups(trainable, current_version, max_staleness)
    current = _version_int(current_version)
    lags = [
        current - v
        for g in trainable
        for s in g
        for v in [_version_int(s.weight_versions[0] if s.weight_versions else None)]
        if current is not None and v is not None
    ]
    return PreparedGroups(
        groups=tuple(trainable),
        failed_samples=failed,
        stale_groups=len(stale),
        max_staleness_seen=max(lags, default=0),
        stale_tokens=sum(s.response_length for g in stale for s in g),
    )


def train_batch_of(
    groups: Sequence[Group],
    algo: AlgorithmConfig,
    *,
    max_new_tokens: int,
    kl_penalties: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
) -> TrainBatch:
    """Final rewards -> advantages (optionally with per-token KL penalties) -> TrainBatch.

    The samples' rewards are final (shaped on the rollout side). Dr.GRPO's constant T_max is the
    sampling budget `max_new_tokens`. `values` (flat, one per sample, aligned with its tokens:
    `values[t]` = V(tokens < t)) are the critic's, for GAE.
    """
    assert groups, "no group to train on"
    token_rewards = None
    if kl_penalties is not None:
        token_rewards = outcome_token_rewards(groups, nest(kl_penalties, groups))
    return build_train_batch(
        groups,
        algo,
        token_rewards=token_rewards,
        values=None if values is None else nest(values, groups),
        max_response_length=max_new_tokens,
    )


def value_input_batch(groups: Sequence[Group]) -> TrainBatch:
    """The token sequences of `groups` (flat), for the critic's pre-update values (GAE)."""
    samples = [s for g in groups for s in g]
    assert samples, "no sample to compute values for"
    return TrainBatch(
        input_ids=long_views([s.tokens for s in samples]),
        loss_mask=mask_views([s.loss_mask for s in samples]),
    )


def epoch_metrics(per_epoch: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`train/clipfrac_epoch{k}`, `train/ratio_abs_dev_epoch{k}` (and value loss) per PPO epoch.

    `per_epoch[k]` holds the epoch's metrics summed over its mini-batches and `_n` their count.
    Epoch 0 starts at ratio 1 (old logprobs are the pre-update weights); later epochs show how far
    the updates moved the policy.
    """
    out: dict[str, float] = {}
    for k, sums in enumerate(per_epoch):
        n = max(sums.get("_n", 0.0), 1.0)
        for key in ("clipfrac", "ratio_abs_dev", "value_loss"):
            if key in sums:
                out[f"train/{key}_epoch{k}"] = sums[key] / n
    return out


def mini_batches(groups: Sequence[Group], mini_batch_size: int) -> list[list[int]]:
    """Sample indices (into the flat batch) of each mini-batch of `mini_batch_size` groups."""
    if mini_batch_size <= 0 or mini_batch_size >= len(groups):
        return [list(range(sum(len(g) for g in groups)))]
    out: list[list[int]] = []
    start = 0
    for first in range(0, len(groups), mini_batch_size):
        size = sum(len(g) for g in groups[first : first + mini_batch_size])
        out.append(list(range(start, start + size)))
        start += size
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def scalar(reward: Any) -> float:
    """A sample's reward as one number (vector rewards: their sum)."""
    if isinstance(reward, tuple):
        return float(sum(reward))
    return float(reward)


def source_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per source of a mixture (the `source` each prompt carries in its metadata): the mean
    reward and accuracy of its scored samples and how many samples it has in the batch;
    nothing when no sample names a source."""
    by_source: dict[str, list[Sample]] = {}
    for s in samples:
        if SOURCE_KEY in s.metadata:
            by_source.setdefault(str(s.metadata[SOURCE_KEY]), []).append(s)
    out: dict[str, float] = {}
    for name, group in sorted(by_source.items()):
        rewards = [scalar(r) for s in group if (r := scored_reward(s)) is not None]
        out[f"source/{name}/samples"] = float(len(group))
        out[f"source/{name}/reward"] = _mean_std(rewards)[0]
        out[f"source/{name}/accuracy"] = (
            sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else math.nan
        )
    return out


def rollout_metrics(groups: Sequence[Group], meta: Mapping[str, Any]) -> dict[str, float]:
    """Reward, accuracy, length and kept/dropped/aborted counts of one rollout batch.

    The `reward/*` figures are of the rewards as scored (`scored_reward`), before shaping; a
    FAILED sample has none (it is counted by reason in `rollout/reward_failed/*`, never a 0).
    The `groups/*` figures (`rollout/signal.py`) are over every group the batch saw reach a
    verdict, the ones a filter dropped too, as the manager counted them (`meta["group_signal"]`);
    without those counts, over `groups`.
    """
    samples = [s for g in groups for s in g]
    rewards = [scalar(r) for s in samples if (r := scored_reward(s)) is not None]
    mean, std = _mean_std(rewards)
    lengths = [s.response_length for s in samples]
    out: dict[str, float] = {
        "reward/mean": mean,
        "reward/std": std,
        "reward/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else math.nan,
        "rollout/response_length_mean": sum(lengths) / len(lengths) if lengths else math.nan,
        "rollout/response_length_max": float(max(lengths, default=0)),
        "rollout/truncated_frac": (
            sum(s.status is Status.TRUNCATED for s in samples) / len(samples) if samples else 0.0
        ),
        "rollout/groups_kept": float(len(groups)),
    }
    counts = meta.get(SIGNAL_KEY) or signal_counts(group_signal(g) for g in groups)
    out |= signal_metrics(counts)  # groups with no signal (all equal), pass@k, reward spread
    out |= episode_metrics(samples)  # multi-turn episodes: tool calls, turns, ends
    out |= source_metrics(samples)  # a mixture: reward, accuracy and samples of each source
    reverse_kl, scored_tokens = reverse_kl_per_token(groups)
    if scored_tokens:  # on-policy distillation: the student's samples scored by the teacher
        out["distill/reverse_kl"] = reverse_kl
        out["distill/scored_tokens"] = float(scored_tokens)
    for key, value in meta.items():
        if isinstance(value, (int, float)):  # bools too: rollout/short_batch is 0 or 1
            out[f"rollout/{key}"] = float(value)
        elif isinstance(value, Mapping) and key in ("drop_reasons", "statuses"):
            for name, count in value.items():
                out[f"rollout/{key}/{name}"] = float(count)
        elif isinstance(value, Mapping) and key == "sources":  # the buffer's: source/<name>/...
            out |= {name: float(v) for name, v in value.items()}
    # rollout/reward_failed, rollout/generate_failed and their reasons (failed samples)
    return out | failure_metrics(meta.get("failures", {}), "rollout")


def advantage_metrics(
    advantages: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor]
) -> dict[str, float]:
    """The distribution of the advantages of the trained tokens (loss_mask 1): `adv/mean`,
    `std`, `abs_mean`, `min`, `max` and `zero_frac` (|A| <= 1e-8: tokens that teach nothing);
    nothing when the batch has no advantages (a loss that makes its own, or no trained token)."""
    assert not advantages or len(advantages) == len(loss_mask), (
        f"{len(advantages)=} != {len(loss_mask)=}"
    )
    if not advantages:
        return {}
    # one mask over the whole batch, not three tensor ops per sequence (32k sequences: seconds)
    flat = joined(advantages).float()[joined(loss_mask) > 0].double()
    if flat.numel() == 0:
        return {}
    size = flat.abs()
    return {
        "adv/mean": float(flat.mean()),
        "adv/std": float(flat.std(correction=0)),
        "adv/abs_mean": float(size.mean()),
        "adv/min": float(flat.min()),
        "adv/max": float(flat.max()),
        "adv/zero_frac": int((size <= 1e-8).sum()) / flat.numel(),
    }


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """`{prefix/key: value}`, for a backend's unprefixed metrics."""
    return {f"{prefix}/{k}" if "/" not in k else k: float(v) for k, v in metrics.items()}


def step_timing(
    times: dict[str, float], step_s: float, rollout: RolloutBatch, version: int
) -> dict[str, float]:
    """A step's phase times (`time/<phase>_s`, the rest `time/idle_s`) and throughput."""
    out = {f"time/{k}_s": v for k, v in times.items()}
    out["time/idle_s"] = max(step_s - sum(times.values()), 0.0)
    n_samples = sum(len(g) for g in rollout.groups)
    tokens = float(rollout.metadata.get("generated_tokens", 0))
    out |= {
        "perf/step_time_s": step_s,
        "perf/samples_per_s": n_samples / step_s if step_s > 0 else 0.0,
        "perf/generated_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "perf/compute_fraction": sum(times.get(k, 0.0) for k in ("generate", "logprobs", "train"))
        / step_s
        if step_s > 0
        else 0.0,
        "policy/version": float(version),
    }
    return out
