"""[algorithm] section and the names its choices are drawn from."""

from __future__ import annotations

import dataclasses
import typing
from typing import ClassVar, Literal

from rollouts.config.base import _check, _one_of, _Section

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADVANTAGES = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "reinforce_pp",  # = reinforce_plus_plus_baseline (the name older configs use)
    "gae",
)
# the policy losses of `rollouts.algorithms.policy_loss.POLICY_LOSSES` (one entry each)
PolicyLossName = Literal["ppo", "reinforce", "gspo", "cispo", "pairwise"]
POLICY_LOSSES = typing.get_args(PolicyLossName)
ROLLOUT_RS_MODES = ("none", "token", "sequence", "geometric")
PAIR_SELECTORS = ("best_vs_worst", "all_pairs_above_margin")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig(_Section):
    """[algorithm]: advantage estimator, policy loss, aggregation, KL and clip settings."""

    KEY: ClassVar[str] = "algorithm"

    advantage: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss: PolicyLossName = "ppo"
    loss_agg: str = "token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"  # "loss" | "reward"
    tis: bool = False
    tis_cap: float = 2.0
    ref_update: str = "none"  # "none" | "copy" | "ema" | "periodic"
    ref_ema_decay: float = 0.99
    ref_update_every: int = 10
    gamma: float = 1.0
    lam: float = 1.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # groups per mini-batch; 0 = the whole batch
    # "auto": on-policy updates (ppo_epochs = 1, one mini-batch) take the old logprobs from the
    # training forward itself (ratio = 1); "always": a separate no-grad pass before the update
    recompute_old_logprobs: str = "auto"
    pair_beta: float = 0.1  # policy_loss = "pairwise": beta of -log sigmoid(beta * margin)
    pair_selector: str = "best_vs_worst"  # | "all_pairs_above_margin" | dotted path to a selector
    pair_margin: float = 0.0  # a pair needs r_chosen - r_rejected > pair_margin
    schedule: str = ""  # dotted path to `rl_step -> AlgorithmConfig` (0-based RL step)
    tis_level: str = "token"  # "token" | "sequence"
    # rejection of samples the engine made too unlike the trainer (verl rollout_rs): drop tokens
    # ("token") or whole sequences ("sequence": product of ratios; "geometric": their geometric
    # mean) whose ratio pi_trainer / pi_engine is outside [threshold_lower, threshold]
    rollout_rs: str = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.0  # 0 = 1 / rollout_rs_threshold
    cispo_clip_eps_low: float = 1.0  # policy_loss = "cispo": weight >= 1 - this (1 = no bound)
    cispo_clip_eps_high: float = 0.28  # policy_loss = "cispo": weight <= 1 + this
    kl_target: float = 0.0  # > 0: adaptive KL coefficient towards this KL (kl_in = "reward")
    kl_horizon: int = 10000  # steps of the adaptive KL controller
    kl_cap: float = 0.0  # > 0: clamp per-token KL at this value
    kl_ignore_ref_above: float = 1.0  # < 1: no KL on tokens the reference gives p > this
    value_coef: float = 0.5  # weight of the critic's loss (advantage = "gae")
    value_clip: float = 0.2  # clip range of the critic's prediction around old values
    value_lr: float = 0.0  # learning rate of the critic's value head; 0 = optim.lr
    ref_update_fn: str = ""  # dotted path, for ref_update = "user"
    reward_transform: str = "absolute"  # "absolute" | "relative" (rank) | "pareto" (vector)
    reward_scope: str = "group"  # where relative / pareto compare: "group" | "batch"
    reward_weights: list[float] = dataclasses.field(default_factory=list)  # vector -> weighted sum
    pareto_mode: str = "rank"  # "rank": 1 / (1 + Pareto rank) | "distance": -distance to front
    reward_norm: str = "none"  # "none" | "group" | "batch": (r - mean) / (std + 1e-6)
    overlong_buffer: int = 0  # > 0: DAPO soft overlong penalty over the last N tokens
    overlong_max_length: int = 0  # the response length the penalty reaches -overlong_penalty
    overlong_penalty: float = 1.0
    efficiency_coef: float = 0.0  # > 0: bonus coef * (1 - len / overlong_max_length) if r > 0

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "algorithm.advantage", self.advantage, ADVANTAGES)
        _one_of(p, "algorithm.loss_agg", self.loss_agg, AGG_MODES)
        _one_of(p, "algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of(p, "algorithm.kl_in", self.kl_in, ("loss", "reward"))
        _one_of(
            p, "algorithm.ref_update", self.ref_update, ("none", "copy", "ema", "periodic", "user")
        )
        _check(
            p,
            self.ref_update != "user" or bool(self.ref_update_fn),
            "algorithm.ref_update_fn: must name a function when algorithm.ref_update = 'user'",
        )
        _one_of(p, "algorithm.tis_level", self.tis_level, ("token", "sequence"))
        _check(p, self.kl_target >= 0.0, "algorithm.kl_target: must be >= 0 (0 = fixed kl_coef)")
        _check(
            p,
            self.kl_target == 0.0 or (self.kl_in == "reward" and self.kl_coef > 0.0),
            f"algorithm.kl_target = {self.kl_target}: the adaptive KL controller steers the KL "
            "in the reward (as verl): set algorithm.kl_in = 'reward' and kl_coef > 0 (its "
            "initial value), or kl_target = 0",
        )
        _one_of(p, "algorithm.rollout_rs", self.rollout_rs, ROLLOUT_RS_MODES)
        _check(
            p,
            self.rollout_rs_threshold > 1.0,
            f"algorithm.rollout_rs_threshold = {self.rollout_rs_threshold}: must be > 1",
        )
        _check(
            p,
            0.0 <= self.rollout_rs_threshold_lower < 1.0,
            f"algorithm.rollout_rs_threshold_lower = {self.rollout_rs_threshold_lower}: must be "
            "in [0, 1) (0 = 1 / rollout_rs_threshold)",
        )
        _check(
            p,
            0.0 <= self.cispo_clip_eps_low <= 1.0,
            f"algorithm.cispo_clip_eps_low = {self.cispo_clip_eps_low}: must be in [0, 1]",
        )
        _check(
            p,
            self.cispo_clip_eps_high >= 0.0,
            f"algorithm.cispo_clip_eps_high = {self.cispo_clip_eps_high}: must be >= 0",
        )
        _check(p, self.kl_horizon >= 1, "algorithm.kl_horizon: must be >= 1")
        _check(p, self.kl_cap >= 0.0, "algorithm.kl_cap: must be >= 0 (0 = no cap)")
        _check(p, 0.0 < self.kl_ignore_ref_above <= 1.0, "algorithm.kl_ignore_ref_above: (0, 1]")
        _check(p, self.value_coef >= 0.0, "algorithm.value_coef: must be >= 0")
        _check(p, self.value_clip > 0.0, "algorithm.value_clip: must be > 0")
        _check(p, self.value_lr >= 0.0, "algorithm.value_lr: must be >= 0 (0 = optim.lr)")
        _one_of(
            p,
            "algorithm.reward_transform",
            self.reward_transform,
            ("absolute", "relative", "pareto"),
        )
        _one_of(p, "algorithm.reward_scope", self.reward_scope, ("group", "batch"))
        _one_of(p, "algorithm.pareto_mode", self.pareto_mode, ("rank", "distance"))
        _one_of(p, "algorithm.reward_norm", self.reward_norm, ("none", "group", "batch"))
        _check(p, self.overlong_buffer >= 0, "algorithm.overlong_buffer: must be >= 0")
        _check(p, self.efficiency_coef >= 0.0, "algorithm.efficiency_coef: must be >= 0")
        _check(
            p,
            (self.overlong_buffer == 0 and self.efficiency_coef == 0)
            or self.overlong_max_length >= max(self.overlong_buffer, 1),
            f"algorithm.overlong_max_length = {self.overlong_max_length}: must be >= "
            "overlong_buffer (and >= 1) when the overlong penalty or efficiency bonus is on",
        )
        _check(
            p,
            self.policy_loss != "gspo" or self.loss_agg == "seq-mean-token-mean",
            f"algorithm.loss_agg = {self.loss_agg!r}: GSPO is defined with "
            "'seq-mean-token-mean'; set algorithm.loss_agg = 'seq-mean-token-mean'",
        )
        _check(p, 0.0 <= self.clip_eps_low < 1.0, "algorithm.clip_eps_low: must be in [0, 1)")
        _check(p, self.clip_eps_high >= 0.0, "algorithm.clip_eps_high: must be >= 0")
        _check(
            p,
            self.clip_ratio_c > 1.0,
            f"algorithm.clip_ratio_c = {self.clip_ratio_c}: must be > 1.0 (dual clip)",
        )
        _check(p, self.kl_coef >= 0.0, "algorithm.kl_coef: must be >= 0")
        _check(p, self.tis_cap >= 1.0, f"algorithm.tis_cap = {self.tis_cap}: must be >= 1.0")
        _check(p, 0.0 <= self.ref_ema_decay <= 1.0, "algorithm.ref_ema_decay: in [0, 1]")
        _check(p, self.ref_update_every >= 1, "algorithm.ref_update_every: must be >= 1")
        _check(p, 0.0 <= self.gamma <= 1.0, "algorithm.gamma: must be in [0, 1]")
        _check(p, 0.0 <= self.lam <= 1.0, "algorithm.lam: must be in [0, 1]")
        _check(p, self.ppo_epochs >= 1, "algorithm.ppo_epochs: must be >= 1")
        _check(p, self.mini_batch_size >= 0, "algorithm.mini_batch_size: must be >= 0")
        _one_of(
            p,
            "algorithm.recompute_old_logprobs",
            self.recompute_old_logprobs,
            ("auto", "always"),
        )
        _check(p, self.pair_beta > 0.0, f"algorithm.pair_beta = {self.pair_beta}: must be > 0")
        _check(p, self.pair_margin >= 0.0, "algorithm.pair_margin: must be >= 0")
        _check(
            p,
            self.pair_selector in PAIR_SELECTORS or "." in self.pair_selector,
            f"algorithm.pair_selector = {self.pair_selector!r}: must be one of {PAIR_SELECTORS} "
            "or a dotted path to a function (group) -> [(chosen, rejected), ...]",
        )
        pairwise = self.policy_loss == "pairwise"
        _check(
            p,
            not pairwise
            or (self.advantage != "gae" and not self.tis and self.rollout_rs == "none"),
            "algorithm.policy_loss = 'pairwise' uses no advantages and no TIS: set "
            "algorithm.advantage to a critic-free estimator (e.g. 'grpo'), tis = false and "
            "rollout_rs = 'none'",
        )
        return p
