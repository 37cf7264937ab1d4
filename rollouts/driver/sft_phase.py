"""The SFT phase of a run: conversations -> tokenized examples with loss masks -> the SFT loop
(`rollouts/loop/sft.py`) -> checkpoints/sft/step_N/model, the model RL starts from.

With LoRA the SFT phase trains an adapter too; the last checkpoint then also gets model/, the
base with that adapter merged in, and RL trains a new adapter on it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import trio

from rollouts.config import Config
from rollouts.data.limits import sft_limit
from rollouts.data.loaders import load_conversations
from rollouts.driver.resume import checkpoint_to_resume, verify_start_model
from rollouts.driver.setup import SFT_METRICS, StopFlag, make_logger
from rollouts.driver.trainer_io import BackendFactory, checkpoint_root, save
from rollouts.loop.sft import (
    TokenizedConversation,
    run_sft_training,
    split_eval,
    tokenize_all,
    total_sft_steps,
)
from rollouts.trainer.checkpoint import clean_leftovers, find_latest_checkpoint, load_checkpoint
from rollouts.trainer.checkpoint_verify import add_to_manifest
from rollouts.trainer.factories import create_backend, load_tokenizer
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.pytorch import MODEL_DIR

Examples = list[TokenizedConversation]


async def sft_phase(
    config: Config,
    run_dir: Path,
    base: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: BackendFactory = create_backend,
    resume_step: int | None = None,
) -> Path:
    """Run (or resume from a verified checkpoint, step `resume_step` when given, or skip when
    already finished) SFT; return the final model directory, the one RL starts from (verified:
    a corrupt one raises `CorruptCheckpoint`)."""
    root = checkpoint_root(config, run_dir, "sft")
    clean_leftovers(root)
    train, held = _sft_examples(config, base)
    total = total_sft_steps(config, len(train))
    latest = await checkpoint_to_resume(config, root, "sft", resume=resume, step=resume_step)
    backend = make_backend(
        dataclasses.replace(config, training=config.training.for_sft()),
        model_path=base,
        total_steps=total,
        lr=config.training.sft_lr or None,
        value_head=False,
    )
    try:
        start = 0
        if latest is not None:
            start = (await trio.to_thread.run_sync(load_checkpoint, backend, latest)).step
        if start < total:
            run = _SftRun(config=config, run_dir=run_dir, root=root, backend=backend, stop=stop)
            await _train_sft(run, train, held, total, start if latest else None)
        final = await _final_model(config, backend, root, latest)
    finally:
        backend.close()
    return final / MODEL_DIR


def _sft_examples(config: Config, base: Path) -> tuple[Examples, Examples]:
    """The tokenized conversations (loss masks from the chat template): (train, held out)."""
    tokenizer = load_tokenizer(base)
    d = config.data
    conversations = load_conversations(
        d.sft_path, d.messages_key, split=d.train_split, subset=d.subset
    )
    examples = tokenize_all(tokenizer, conversations, sft_limit(base, config.data.max_length))
    return split_eval(examples, config.data.sft_eval_fraction, config.run.seed)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _SftRun:
    """Where the SFT loop trains and writes (fixed for the phase)."""

    config: Config
    run_dir: Path
    root: Path  # checkpoints/sft
    backend: TrainingBackend
    stop: StopFlag


async def _train_sft(
    run: _SftRun, train: Examples, held: Examples, total: int, resumed: int | None
) -> None:
    """The SFT loop from step `resumed` (None: a new run) to `total`, a checkpoint as it asks."""
    config, backend = run.config, run.backend
    logger = make_logger(config, run.run_dir / SFT_METRICS, total, "sft ", resumed)

    async def checkpoint(step: int) -> None:
        keep = config.checkpoint.keep_last
        await save(backend, run.root, step, f"sft-{step}", {"phase": "sft"}, keep)

    print(f"[train] SFT: {len(train)} conversations, {total} steps", flush=True)
    result = await run_sft_training(
        backend,
        train,
        config,
        logger,
        eval_examples=held,
        start_step=resumed or 0,
        checkpoint=checkpoint,
        should_stop=run.stop,
    )
    logger.close()
    held_out = (
        f"; held-out loss {result.eval_loss:.4f}, token accuracy {result.eval_accuracy:.3f}"
        if result.eval_loss is not None and result.eval_accuracy is not None
        else ""
    )
    print(f"[train] SFT done: loss {result.final_loss:.4f}{held_out}", flush=True)


async def _final_model(
    config: Config, backend: TrainingBackend, root: Path, latest: Path | None
) -> Path:
    """The phase's last checkpoint, with model/ (LoRA: the merged model, written now) verified
    when this run wrote it (a resumed one was verified already)."""
    final = find_latest_checkpoint(root)
    assert final is not None, f"SFT wrote no checkpoint under {root}"
    if config.model.lora.enabled and not (final / MODEL_DIR).is_dir():
        await trio.to_thread.run_sync(_write_merged, backend, final / MODEL_DIR)
        await trio.to_thread.run_sync(add_to_manifest, final, MODEL_DIR)
    if final != latest:
        await trio.to_thread.run_sync(verify_start_model, final / MODEL_DIR)
    return final


def _write_merged(backend: TrainingBackend, path: Path) -> None:
    """The backend's weights (LoRA: merged) as an HF directory at `path`, written under a
    temporary name and renamed (a kill never leaves a half-written `path`)."""
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    backend.save_weights(tmp).result()
    tmp.rename(path)
