"""The SFT phase of a run: conversations -> tokenized examples with loss masks -> the SFT loop
(`rollouts/loop/sft.py`) -> checkpoints/sft/step_N/model, the model RL starts from."""

from __future__ import annotations

from pathlib import Path

import trio

from rollouts.config import Config
from rollouts.data.limits import sft_limit
from rollouts.data.loaders import load_conversations
from rollouts.driver.setup import SFT_METRICS, StopFlag, make_logger
from rollouts.driver.trainer_io import BackendFactory, checkpoint_root, save
from rollouts.loop.sft import run_sft_training, split_eval, tokenize_all, total_sft_steps
from rollouts.trainer.checkpoint import clean_leftovers, find_latest_checkpoint, load_checkpoint
from rollouts.trainer.factories import create_backend, load_tokenizer
from rollouts.trainer.pytorch import MODEL_DIR


async def sft_phase(
    config: Config,
    run_dir: Path,
    base: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: BackendFactory = create_backend,
) -> Path:
    """Run (or resume, or skip when already finished) SFT; return the final model directory."""
    root = checkpoint_root(config, run_dir, "sft")
    clean_leftovers(root)
    tokenizer = load_tokenizer(base)
    conversations = load_conversations(config.data.sft_path, config.data.messages_key)
    examples = tokenize_all(tokenizer, conversations, sft_limit(base, config.data.max_length))
    train, held = split_eval(examples, config.data.sft_eval_fraction, config.run.seed)
    total = total_sft_steps(config, len(train))
    latest = find_latest_checkpoint(root) if resume else None
    backend = make_backend(
        config,
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
            logger = make_logger(
                config, run_dir / SFT_METRICS, total, "sft ", start if latest else None
            )

            async def checkpoint(step: int) -> None:
                keep = config.checkpoint.keep_last
                await save(backend, root, step, f"sft-{step}", {"phase": "sft"}, keep)

            print(f"[train] SFT: {len(train)} conversations, {total} steps", flush=True)
            result = await run_sft_training(
                backend,
                train,
                config,
                logger,
                eval_examples=held,
                start_step=start,
                checkpoint=checkpoint,
                should_stop=stop,
            )
            logger.close()
            print(f"[train] SFT done: loss {result.final_loss:.4f} eval {result.eval_loss}")
    finally:
        backend.close()
    final = find_latest_checkpoint(root)
    assert final is not None, f"SFT wrote no checkpoint under {root}"
    return final / MODEL_DIR
