"""The sub-tables of [algorithm]: each mode's own keys live in its own table.

[algorithm.kl] (the KL to the reference), [algorithm.reference] (how the reference moves),
[algorithm.gae] (GAE and its critic), [algorithm.rollout_correction] (engine-vs-trainer mismatch:
TIS and rejection), and one table per policy loss with keys of its own ([algorithm.cispo],
[algorithm.truncated_is], [algorithm.pairwise]). Each checks its own ranges; `AlgorithmConfig`
checks how they combine.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

KLEstimator = Literal["k1", "abs", "k2", "k3"]
KLInto = Literal["loss", "reward"]  # a term of the loss | a per-token penalty of the reward
RefUpdate = Literal["none", "copy", "ema", "periodic", "user"]
TISLevel = Literal["token", "sequence"]
RejectionMode = Literal["none", "token", "sequence", "geometric"]
PAIR_SELECTORS = ("best_vs_worst", "all_pairs_above_margin")  # or a dotted path to a selector


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KLConfig(_Section):
    """[algorithm.kl]: the KL to the reference model, in the loss or in the reward."""

    KEY: ClassVar[str] = "algorithm.kl"

    coef: float = 0.0  # 0 = no KL (and no reference model for it)
    estimator: KLEstimator = "k3"
    into: KLInto = "loss"
    target: float = 0.0  # > 0: adaptive coefficient towards this KL (into = "reward")
    horizon: int = 10000  # steps of the adaptive KL controller
    cap: float = 0.0  # > 0: clamp per-token KL at this value
    ignore_ref_above: float = 1.0  # < 1: no KL on tokens the reference gives p > this

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.coef >= 0.0, "algorithm.kl.coef: must be >= 0")
        _check(p, self.target >= 0.0, "algorithm.kl.target: must be >= 0 (0 = fixed coef)")
        _check(
            p,
            self.target == 0.0 or (self.into == "reward" and self.coef > 0.0),
            f"algorithm.kl.target = {self.target}: the adaptive KL controller steers the KL "
            "in the reward (as verl): set algorithm.kl.into = 'reward' and kl.coef > 0 (its "
            "initial value), or kl.target = 0",
        )
        _check(p, self.horizon >= 1, "algorithm.kl.horizon: must be >= 1")
        _check(p, self.cap >= 0.0, "algorithm.kl.cap: must be >= 0 (0 = no cap)")
        _check(p, 0.0 < self.ignore_ref_above <= 1.0, "algorithm.kl.ignore_ref_above: (0, 1]")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceConfig(_Section):
    """[algorithm.reference]: how the reference model moves after each optimizer step."""

    KEY: ClassVar[str] = "algorithm.reference"

    update: RefUpdate = "none"
    ema_decay: float = 0.99  # update = "ema": ref <- decay * ref + (1 - decay) * policy
    update_every: int = 10  # update = "periodic": copy the policy every N steps
    update_fn: str = ""  # update = "user": dotted path to (ref, policy, step) -> new ref

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            self.update != "user" or bool(self.update_fn),
            "algorithm.reference.update_fn: must name a function when "
            "algorithm.reference.update = 'user'",
        )
        _check(p, 0.0 <= self.ema_decay <= 1.0, "algorithm.reference.ema_decay: in [0, 1]")
        _check(p, self.update_every >= 1, "algorithm.reference.update_every: must be >= 1")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GAEConfig(_Section):
    """[algorithm.gae]: GAE's lambda and its critic (advantage = "gae")."""

    KEY: ClassVar[str] = "algorithm.gae"

    lam: float = 1.0
    value_coef: float = 0.5  # weight of the critic's loss
    value_clip: float = 0.2  # clip range of the critic's prediction around old values
    value_lr: float = 0.0  # learning rate of the critic's value head; 0 = optim.lr

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, 0.0 <= self.lam <= 1.0, "algorithm.gae.lam: must be in [0, 1]")
        _check(p, self.value_coef >= 0.0, "algorithm.gae.value_coef: must be >= 0")
        _check(p, self.value_clip > 0.0, "algorithm.gae.value_clip: must be > 0")
        _check(p, self.value_lr >= 0.0, "algorithm.gae.value_lr: must be >= 0 (0 = optim.lr)")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionConfig(_Section):
    """[algorithm.rollout_correction]: samples the engine made with other numerics than the
    trainer's. TIS weighs each token's policy loss by min(pi_trainer / pi_engine, tis_cap);
    rejection (verl rollout_rs) drops tokens ("token") or whole sequences ("sequence": product of
    ratios; "geometric": their geometric mean) whose ratio is outside [threshold_lower,
    threshold]."""

    KEY: ClassVar[str] = "algorithm.rollout_correction"

    tis: bool = False
    tis_cap: float = 2.0
    tis_level: TISLevel = "token"
    rejection: RejectionMode = "none"
    rejection_threshold: float = 2.0
    rejection_threshold_lower: float = 0.0  # 0 = 1 / rejection_threshold

    @property
    def enabled(self) -> bool:
        return self.tis or self.rejection != "none"

    def problems(self) -> list[str]:
        p: list[str] = []
        key = "algorithm.rollout_correction"
        _check(p, self.tis_cap >= 1.0, f"{key}.tis_cap = {self.tis_cap}: must be >= 1.0")
        _check(
            p,
            self.rejection_threshold > 1.0,
            f"{key}.rejection_threshold = {self.rejection_threshold}: must be > 1",
        )
        _check(
            p,
            0.0 <= self.rejection_threshold_lower < 1.0,
            f"{key}.rejection_threshold_lower = {self.rejection_threshold_lower}: must be in "
            "[0, 1) (0 = 1 / rejection_threshold)",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CispoConfig(_Section):
    """[algorithm.cispo]: the clip of CISPO's detached importance weight (policy_loss = "cispo")."""

    KEY: ClassVar[str] = "algorithm.cispo"

    clip_eps_low: float = 1.0  # weight >= 1 - this (1 = no bound)
    clip_eps_high: float = 0.28  # weight <= 1 + this

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            0.0 <= self.clip_eps_low <= 1.0,
            f"algorithm.cispo.clip_eps_low = {self.clip_eps_low}: must be in [0, 1]",
        )
        _check(
            p,
            self.clip_eps_high >= 0.0,
            f"algorithm.cispo.clip_eps_high = {self.clip_eps_high}: must be >= 0",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TruncatedISConfig(_Section):
    """[algorithm.truncated_is]: the truncation of its detached importance weight
    (policy_loss = "truncated_is": weight = min(pi / pi_old, cap))."""

    KEY: ClassVar[str] = "algorithm.truncated_is"

    cap: float = 2.0  # C of the reference sheet's TIS

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.cap >= 1.0, f"algorithm.truncated_is.cap = {self.cap}: must be >= 1.0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PairwiseConfig(_Section):
    """[algorithm.pairwise]: -log sigmoid(beta * margin) over (chosen, rejected) pairs."""

    KEY: ClassVar[str] = "algorithm.pairwise"

    beta: float = 0.1
    selector: str = "best_vs_worst"  # | "all_pairs_above_margin" | dotted path to a selector
    margin: float = 0.0  # a pair needs r_chosen - r_rejected > margin

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.beta > 0.0, f"algorithm.pairwise.beta = {self.beta}: must be > 0")
        _check(p, self.margin >= 0.0, "algorithm.pairwise.margin: must be >= 0")
        _check(
            p,
            self.selector in PAIR_SELECTORS or "." in self.selector,
            f"algorithm.pairwise.selector = {self.selector!r}: must be one of {PAIR_SELECTORS} "
            "or a dotted path to a function (group) -> [(chosen, rejected), ...]",
        )
        return p


# the critic-free estimators the task reward's advantage may come from beside distillation
DISTILL_TASK_ADVANTAGES = ("", "grpo", "dr_grpo", "rloo")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistillConfig(_Section):
    """[algorithm.distill] (advantage = "distill"): on-policy distillation from the [teacher].

    Each sampled token's advantage is coef * -(log pi_student - log pi_teacher), the negative
    per-token reverse KL of the student's own sample (its logprobs as the engine sampled it,
    the teacher's as it scored the same tokens); `task_advantage` adds the task reward's
    advantage (a critic-free estimator's), weighted by `task_weight`.

    `top_k` = K > 0 learns the teacher's distribution instead of its opinion of the one sampled
    token: at every sampled token's position the teacher returns its K likeliest tokens, and
    the loss adds coef * KL(teacher || student) over them (the teacher's K renormalised; the
    student's full-vocabulary logprobs of those K), aggregated as the policy loss is. The
    sampled token's advantage is then 0 (a task advantage still applies)."""

    KEY: ClassVar[str] = "algorithm.distill"

    coef: float = 1.0
    task_advantage: str = ""  # "" = none; "grpo", "dr_grpo" or "rloo"
    task_weight: float = 1.0
    top_k: int = 0  # 0 = the sampled token's reverse KL; 1..20 = the teacher's top-K in the loss

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.coef > 0.0, f"algorithm.distill.coef = {self.coef}: must be > 0")
        _check(
            p,
            self.task_advantage in DISTILL_TASK_ADVANTAGES,
            f"algorithm.distill.task_advantage = {self.task_advantage!r}: must be one of "
            f'{list(DISTILL_TASK_ADVANTAGES)} ("" = the reverse KL alone)',
        )
        _check(
            p,
            self.task_weight >= 0.0,
            f"algorithm.distill.task_weight = {self.task_weight}: must be >= 0",
        )
        _check(
            p,
            0 <= self.top_k <= 20,
            f"algorithm.distill.top_k = {self.top_k}: must be in [0, 20] (engines return at "
            "most 20 logprobs a position; 0 = the sampled token's reverse KL)",
        )
        return p
