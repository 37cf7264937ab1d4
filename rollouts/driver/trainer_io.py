"""What both phases do with their trainer: where its checkpoints go, how one is written, and the
type of the function that builds it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Protocol

import trio

from rollouts.config import Config
from rollouts.trainer.checkpoint import BestSpec, save_checkpoint
from rollouts.trainer.protocol import TrainingBackend


class BackendFactory(Protocol):
    """Builds a phase's trainer: `create_backend`, a trainer process's `create`, or the torchrun
    hub's (rank 0 drives, the other ranks mirror its calls)."""

    def __call__(self, config: Config, **kwargs: Any) -> TrainingBackend: ...


def checkpoint_root(config: Config, run_dir: Path, phase: str) -> Path:
    return Path(config.checkpoint.dir or run_dir / "checkpoints") / phase


async def save(
    backend: TrainingBackend,
    root: Path,
    step: int,
    version: str,
    extra: dict,
    keep: int,
    metrics: Any = None,
    best: BestSpec | None = None,
    reference: Any = None,
) -> None:
    """`save_checkpoint` in a thread (the event loop keeps serving)."""
    await trio.to_thread.run_sync(
        functools.partial(
            save_checkpoint,
            backend,
            root,
            step=step,
            weight_version=version,
            extra_state=extra,
            keep_last=keep,
            metrics=metrics,
            best=best,
            reference=reference,
        )
    )
