"""`Algorithm`: what one step's algorithm needs, asked in one place.

The loop, the driver and the backend never test the config's strings: they ask an `Algorithm`
(built from the step's `AlgorithmConfig`) whether it needs a reference model, a critic, the
entropy's gradient, old logprobs from a pass of their own, or a per-step batch preparation; the
answers come from the advantage estimator (`advantages.needs_critic`) and the policy loss
(`policy_loss.POLICY_LOSSES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollouts.algorithms.advantages import needs_critic
from rollouts.algorithms.policy_loss import PolicyLoss, policy_loss_of
from rollouts.config import AlgorithmConfig
from rollouts.types import Sample, TrainBatch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Algorithm:
    """One step's algorithm: its config, and what the loop and the backend must give it."""

    config: AlgorithmConfig

    @property
    def policy(self) -> PolicyLoss:
        """The policy loss `config.policy_loss` names (its term and its needs)."""
        return policy_loss_of(self.config)

    @property
    def needs_critic(self) -> bool:
        """A critic's values before the update (the advantage estimator uses them)."""
        return needs_critic(self.config)

    @property
    def needs_values(self) -> bool:
        """The critic's values in the training forward (the value loss trains them)."""
        return self.needs_critic and self.config.gae.value_coef > 0.0

    @property
    def needs_entropy(self) -> bool:
        """The entropy with its gradient (an entropy bonus); else it is a detached metric."""
        return self.config.entropy_coef != 0.0

    @property
    def kl_in_loss(self) -> bool:
        """A KL term in the loss (against the reference's logprobs)."""
        return self.config.kl.into == "loss" and self.config.kl.coef > 0.0

    @property
    def kl_in_reward(self) -> bool:
        """A per-token KL penalty in the rewards, before the advantages (old vs reference)."""
        return self.config.kl.into == "reward" and self.config.kl.coef > 0.0

    @property
    def needs_reference(self) -> bool:
        """The reference model's logprobs: a KL term (loss or reward) or the policy loss's own."""
        return self.config.kl.coef > 0.0 or self.policy.needs_reference

    def needs_old_logprobs_pass(self, num_mini_batches: int) -> bool:
        """Whether the old logprobs need their own no-grad pass before the update.

        An on-policy update (one epoch, one mini-batch) runs its forward with the pre-update
        weights, so its own detached logprobs ARE the old ones: the pass is redundant. Later
        epochs or mini-batches run after an optimizer step and need them; so does a policy loss
        that uses them before the forward (pairwise); `algorithm.recompute_old_logprobs =
        "always"` asks for the pass regardless.
        """
        assert num_mini_batches >= 1, f"{num_mini_batches=}"
        if self.config.recompute_old_logprobs == "always":
            return True
        assert self.config.recompute_old_logprobs == "auto", f"{self.config=}"
        return self.config.ppo_epochs > 1 or num_mini_batches > 1 or self.policy.needs_old_logprobs

    def prepare(self, batch: TrainBatch, groups: Sequence[Sequence[Sample]]) -> TrainBatch:
        """The batch one optimizer step trains on (`groups`: its samples, flat and in order)."""
        prepare = self.policy.prepare
        return batch if prepare is None else prepare(batch, groups, self.config)

    def with_kl_in_reward_applied(self) -> Algorithm:
        """The algorithm once the KL is in the rewards: no KL in the loss, no controller."""
        assert self.kl_in_reward, f"{self.config.kl=}"
        kl = dataclasses.replace(self.config.kl, coef=0.0, target=0.0)
        config = dataclasses.replace(self.config, kl=kl)
        return dataclasses.replace(self, config=config)


def needs_old_logprobs_pass(config: AlgorithmConfig, num_mini_batches: int) -> bool:
    """`Algorithm.needs_old_logprobs_pass` of `config`."""
    return Algorithm(config=config).needs_old_logprobs_pass(num_mini_batches)


def reference_needed(config: AlgorithmConfig) -> bool:
    """Whether a run needs a reference model: its algorithm uses one, or its schedule may."""
    return bool(config.schedule) or Algorithm(config=config).needs_reference
