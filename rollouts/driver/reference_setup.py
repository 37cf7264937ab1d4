"""The RL phase's reference policy (the KL terms' model): built when the algorithm needs one,
pinned beside the trainer, and restored from the checkpoint once it has moved off the base model.
With LoRA it is the policy's own base model (its adapters off)."""

from __future__ import annotations

from pathlib import Path

import trio

from rollouts.algorithms.algorithm import reference_needed
from rollouts.config import Config
from rollouts.driver.placement import CpuPlan
from rollouts.driver.trainer_io import BackendFactory
from rollouts.trainer.checkpoint import load_reference_params
from rollouts.trainer.factories import create_backend
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.reference import ReferencePolicy


async def open_reference(
    config: Config,
    model_dir: Path,
    make: BackendFactory,
    plan: CpuPlan | None,
    latest: Path | None,
    policy: TrainingBackend,
) -> ReferencePolicy | None:
    """The reference policy when the algorithm needs one, restored from `latest` if it moved."""
    ref = build_reference(config, model_dir, make, policy)
    if ref is None or ref.backend is None:
        return ref
    if plan is not None and plan.trainer:  # colocated: nothing is pinned
        ref.backend.pin_thread(plan.trainer)
    if latest is not None:
        await trio.to_thread.run_sync(restore_reference, ref, latest)
    return ref


def build_reference(
    config: Config,
    model_dir: Path,
    make_backend: BackendFactory = create_backend,
    policy: TrainingBackend | None = None,
) -> ReferencePolicy | None:
    """A reference model when the algorithm (or its schedule) can use KL; else None. With LoRA
    it is the `policy`'s base model (its adapters off): no second model."""
    if not reference_needed(config.algorithm):
        return None
    adapters = policy.lora_adapters() if policy is not None else None
    if adapters is not None:
        print("[train] reference model: the base model (the LoRA adapters off)", flush=True)
        return ReferencePolicy.base_of(adapters)
    return ReferencePolicy(
        make_backend(config, model_path=model_dir, total_steps=1, value_head=False)
    )


def restore_reference(ref: ReferencePolicy, checkpoint: Path) -> bool:
    """Load the reference parameters `checkpoint` saved into `ref` (True), or leave it on the
    base model when the checkpoint saved none (it had not moved yet)."""
    saved = load_reference_params(checkpoint)
    if saved is None:
        return False
    ref.restore(saved)
    print(f"[train] reference model restored from {checkpoint}", flush=True)
    return True
