"""[algorithm] section: the estimator, the policy loss and the update; its modes' sub-tables.

The keys every algorithm has live here; a mode's own keys live in its sub-table
(`algorithm_tables`: kl, reference, gae, rollout_correction, and one per policy loss with keys of
its own). The policy losses are `rollouts.algorithms.policy_loss.POLICY_LOSSES`, one entry per
name of `PolicyLossName`; the keys that left the flat table are in `ALGORITHM_MOVED_KEYS`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import ClassVar, Literal

from rollouts.config.algorithm_tables import (
    CispoConfig,
    DistillConfig,
    GAEConfig,
    KLConfig,
    KLEstimator,
    PairwiseConfig,
    ReferenceConfig,
    RolloutCorrectionConfig,
    TruncatedISConfig,
)
from rollouts.config.base import _check, _Section

AdvantageName = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "reinforce_pp",  # = reinforce_plus_plus_baseline (the name older configs use)
    "gae",
    "distill",  # the [teacher]'s per-token reverse KL ([algorithm.distill])
]
PolicyLossName = Literal["ppo", "reinforce", "gspo", "cispo", "truncated_is", "pairwise"]
AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
# "auto": on-policy updates (ppo_epochs = 1, one mini-batch) take the old logprobs from the
# training forward itself (ratio = 1); "always": a separate no-grad pass before the update
RecomputeOldLogprobs = Literal["auto", "always"]

ADVANTAGES = typing.get_args(AdvantageName)
POLICY_LOSSES = typing.get_args(PolicyLossName)
AGG_MODES = typing.get_args(AggMode)
KL_ESTIMATORS = typing.get_args(KLEstimator)

# Keys that left the flat [algorithm] table: old dotted path -> new one (the loader reads both
# for one release, with a line naming the new key).
ALGORITHM_MOVED_KEYS: dict[str, str] = {
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.kl_in": "algorithm.kl.into",
    "algorithm.kl_target": "algorithm.kl.target",
    "algorithm.kl_horizon": "algorithm.kl.horizon",
    "algorithm.kl_cap": "algorithm.kl.cap",
    "algorithm.kl_ignore_ref_above": "algorithm.kl.ignore_ref_above",
    "algorithm.ref_update": "algorithm.reference.update",
    "algorithm.ref_ema_decay": "algorithm.reference.ema_decay",
    "algorithm.ref_update_every": "algorithm.reference.update_every",
    "algorithm.ref_update_fn": "algorithm.reference.update_fn",
    "algorithm.lam": "algorithm.gae.lam",
    "algorithm.value_coef": "algorithm.gae.value_coef",
    "algorithm.value_clip": "algorithm.gae.value_clip",
    "algorithm.value_lr": "algorithm.gae.value_lr",
    "algorithm.tis": "algorithm.rollout_correction.tis",
    "algorithm.tis_cap": "algorithm.rollout_correction.tis_cap",
    "algorithm.tis_level": "algorithm.rollout_correction.tis_level",
    "algorithm.rollout_rs": "algorithm.rollout_correction.rejection",
    "algorithm.rollout_rs_threshold": "algorithm.rollout_correction.rejection_threshold",
    "algorithm.rollout_rs_threshold_lower": (
        "algorithm.rollout_correction.rejection_threshold_lower"
    ),
    "algorithm.cispo_clip_eps_low": "algorithm.cispo.clip_eps_low",
    "algorithm.cispo_clip_eps_high": "algorithm.cispo.clip_eps_high",
    "algorithm.pair_beta": "algorithm.pairwise.beta",
    "algorithm.pair_selector": "algorithm.pairwise.selector",
    "algorithm.pair_margin": "algorithm.pairwise.margin",
    "algorithm.reward_transform": "reward.transform",
    "algorithm.reward_scope": "reward.scope",
    "algorithm.reward_weights": "reward.weights",
    "algorithm.pareto_mode": "reward.pareto_mode",
    "algorithm.reward_norm": "reward.norm",
    "algorithm.overlong_buffer": "reward.length.overlong_buffer",
    "algorithm.overlong_max_length": "reward.length.max_length",
    "algorithm.overlong_penalty": "reward.length.overlong_penalty",
    "algorithm.efficiency_coef": "reward.length.efficiency_coef",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig(_Section):
    """[algorithm]: advantage estimator, policy loss, aggregation, clip and update settings."""

    KEY: ClassVar[str] = "algorithm"

    advantage: AdvantageName = "grpo"
    norm_adv_by_std: bool = True  # grpo: divide by the group's std (false: Dr.GRPO's scores)
    gamma: float = 1.0  # discount of the reward-to-go (reinforce*) and of GAE
    policy_loss: PolicyLossName = "ppo"
    loss_agg: AggMode = "token-mean"
    clip_eps_low: float = 0.2  # the PPO / GSPO clip: ratio in [1 - low, 1 + high]
    clip_eps_high: float = 0.2
    clip_ratio_c: float = 3.0  # PPO's dual clip
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # groups per mini-batch; 0 = the whole batch
    recompute_old_logprobs: RecomputeOldLogprobs = "auto"
    schedule: str = ""  # dotted path to `rl_step -> AlgorithmConfig` (0-based RL step)
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    gae: GAEConfig = dataclasses.field(default_factory=GAEConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(
        default_factory=RolloutCorrectionConfig
    )
    cispo: CispoConfig = dataclasses.field(default_factory=CispoConfig)
    truncated_is: TruncatedISConfig = dataclasses.field(default_factory=TruncatedISConfig)
    pairwise: PairwiseConfig = dataclasses.field(default_factory=PairwiseConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, 0.0 <= self.clip_eps_low < 1.0, "algorithm.clip_eps_low: must be in [0, 1)")
        _check(p, self.clip_eps_high >= 0.0, "algorithm.clip_eps_high: must be >= 0")
        _check(
            p,
            self.clip_ratio_c > 1.0,
            f"algorithm.clip_ratio_c = {self.clip_ratio_c}: must be > 1.0 (dual clip)",
        )
        _check(p, 0.0 <= self.gamma <= 1.0, "algorithm.gamma: must be in [0, 1]")
        _check(p, self.ppo_epochs >= 1, "algorithm.ppo_epochs: must be >= 1")
        _check(p, self.mini_batch_size >= 0, "algorithm.mini_batch_size: must be >= 0")
        return p + self._policy_loss_problems()

    def _policy_loss_problems(self) -> list[str]:
        """How the policy loss combines with the rest (each loss's own keys check themselves)."""
        p: list[str] = []
        _check(
            p,
            self.policy_loss != "gspo" or self.loss_agg == "seq-mean-token-mean",
            f"algorithm.loss_agg = {self.loss_agg!r}: GSPO is defined with "
            "'seq-mean-token-mean'; set algorithm.loss_agg = 'seq-mean-token-mean'",
        )
        _check(
            p,
            self.policy_loss != "pairwise"
            or (self.advantage != "gae" and not self.rollout_correction.enabled),
            "algorithm.policy_loss = 'pairwise' uses no advantages and no TIS: set "
            "algorithm.advantage to a critic-free estimator (e.g. 'grpo'), "
            "algorithm.rollout_correction.tis = false and rejection = 'none'",
        )
        return p
