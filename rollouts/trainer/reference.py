"""The reference policy the KL terms compare against: a logprob-only backend beside the policy's,
its parameters, and the update strategy (`algorithms/reference.py`) applied after each step.

Its parameters are checkpointed once they move off the base model (`params_to_checkpoint`), so a
resumed run compares against the same reference.
"""

from __future__ import annotations

from typing import Any

import trio

from rollouts.algorithms.reference import reference_moves, update_reference
from rollouts.config import AlgorithmConfig
from rollouts.trainer.protocol import TrainingBackend
from rollouts.types import TrainBatch


class ReferencePolicy:
    """The reference model (for KL): a logprob-only backend and its update strategy."""

    def __init__(self, backend: TrainingBackend) -> None:
        self.backend = backend
        self.params = backend.get_weights()
        self.changed = False  # moved off the base model: checkpointed from then on

    def restore(self, params: Any) -> None:
        """Load reference parameters saved in a checkpoint (a resumed run)."""
        self.params, self.changed = params, True
        self.backend.load_weights(params)

    def params_to_checkpoint(self) -> Any:
        """The parameters a checkpoint must keep: None while they are the base model's."""
        return self.params if self.changed else None

    async def logprobs(self, batch: TrainBatch) -> tuple[Any, ...]:
        return await self.backend.compute_logprobs(batch)

    async def update(
        self, policy_backend: TrainingBackend, algo: AlgorithmConfig, step: int
    ) -> None:
        """Apply `algo.reference` ([algorithm.reference]) after optimizer step `step`."""
        if not reference_moves(algo.reference):
            return
        policy = await trio.to_thread.run_sync(policy_backend.get_weights)
        new = update_reference(self.params, policy, algo.reference, step)
        if new is not self.params:
            self.params, self.changed = new, True
            await trio.to_thread.run_sync(self.backend.load_weights, new)
