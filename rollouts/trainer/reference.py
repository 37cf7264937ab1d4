"""The reference policy the KL terms compare against: a logprob-only backend beside the policy's,
its parameters, and the update strategy (`algorithms/reference.py`) applied after each step.

Its parameters are checkpointed once they move off the base model (`params_to_checkpoint`), so a
resumed run compares against the same reference.

With LoRA the reference is free: the base model is the policy's own frozen weights, so its
logprobs are the policy backend's with the adapters switched off (`ReferencePolicy.base_of`);
no second model is built and nothing is checkpointed (the base never moves).
"""

from __future__ import annotations

from typing import Any

import trio

from rollouts.algorithms.reference import reference_moves, update_reference
from rollouts.config import AlgorithmConfig
from rollouts.trainer.protocol import LoraAdapters, TrainingBackend
from rollouts.types import TrainBatch


class ReferencePolicy:
    """The reference model (for KL): a logprob-only backend and its update strategy, or the
    LoRA policy's base model (`base_of`)."""

    def __init__(
        self, backend: TrainingBackend | None, *, base: LoraAdapters | None = None
    ) -> None:
        assert (backend is None) != (base is None), "a reference backend, or a LoRA base: one"
        self.backend = backend  # None: the reference is the LoRA policy's base model
        self.base = base
        self.params = backend.get_weights() if backend is not None else None
        self.changed = False  # moved off the base model: checkpointed from then on

    @classmethod
    def base_of(cls, adapters: LoraAdapters) -> ReferencePolicy:
        """The base model under a LoRA policy: its logprobs with the adapters off."""
        return cls(None, base=adapters)

    def restore(self, params: Any) -> None:
        """Load reference parameters saved in a checkpoint (a resumed run)."""
        if self.backend is None:
            raise ValueError(
                "the checkpoint holds reference parameters, but with LoRA the reference is the "
                "base model: resume with the config the checkpoint was written with"
            )
        self.params, self.changed = params, True
        self.backend.load_weights(params)

    def params_to_checkpoint(self) -> Any:
        """The parameters a checkpoint must keep: None while they are the base model's."""
        return self.params if self.changed else None

    async def logprobs(self, batch: TrainBatch) -> tuple[Any, ...]:
        if self.base is not None:
            return await self.base.compute_base_logprobs(batch)
        assert self.backend is not None, "no reference backend"
        return await self.backend.compute_logprobs(batch)

    async def update(
        self, policy_backend: TrainingBackend, algo: AlgorithmConfig, step: int
    ) -> None:
        """Apply `algo.reference` ([algorithm.reference]) after optimizer step `step`."""
        if not reference_moves(algo.reference):
            return
        assert self.backend is not None, "a LoRA base reference never moves (config checks it)"
        policy = await trio.to_thread.run_sync(policy_backend.get_weights)
        new = update_reference(self.params, policy, algo.reference, step)
        if new is not self.params:
            self.params, self.changed = new, True
            await trio.to_thread.run_sync(self.backend.load_weights, new)
