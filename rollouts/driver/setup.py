"""Start-up of a run: the run directory, the resolved config, data files, the base model, signals.

Everything here happens once, before the loops, and fails early with a message that names the
key or the file to fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import trio

from rollouts.config import Config, config_to_dict
from rollouts.data.limits import drop_overlong_prompts, prompt_limit
from rollouts.data.loaders import ChatWrap, DatasetError, load_prompts
from rollouts.data.sft import tokenize_prompt
from rollouts.data.sources import source_kind
from rollouts.data.text_decode import response_decoder
from rollouts.driver.lock import LOCK_NAME
from rollouts.driver.memory import MemoryWatch
from rollouts.driver.metrics import ConsoleSink, JsonlSink, MetricsLogger, truncate_jsonl
from rollouts.models.sources import download_hub_model, fetch_source, looks_like_hub_id
from rollouts.models.tiny import TinyModelSpec, make_tiny_model, spec_differences
from rollouts.plugins import import_object, is_async_callable
from rollouts.trainer.disk_errors import write_error
from rollouts.types import PromptItem

SFT_METRICS = "sft_metrics.jsonl"
RL_METRICS = "metrics.jsonl"
ROLLOUTS = "rollouts.jsonl"
EVAL_ROLLOUTS = "eval_rollouts.jsonl"


class StopFlag:
    """Set by SIGINT/SIGTERM: the loops finish the step, checkpoint, stop the engines, return."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None


async def watch_signals(stop: StopFlag, cancel: trio.CancelScope) -> None:
    """First SIGINT/SIGTERM: ask for a clean stop. Second: cancel everything now."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if stop():
                print("[train] second signal: stopping now", flush=True)
                cancel.cancel()
                return
            stop.signal = signum
            name = signal.Signals(signum).name
            print(f"[train] {name}: finishing this step, writing a checkpoint", flush=True)


def prepare_run_dir(config: Config, config_path: str, resume: bool) -> Path:
    """Create (or, with run.overwrite and no --resume, empty) the run directory; its lock
    (`run_lock.LOCK_NAME`, held by this run) stays."""
    run_dir = Path(config.run.output_dir)
    has_state = (run_dir / "checkpoints").exists()
    if has_state and not resume:
        if not config.run.overwrite:
            raise FileExistsError(
                f"run.output_dir = {str(run_dir)!r} holds checkpoints of an earlier run: pass "
                "--resume to continue it, set run.overwrite = true to replace it, or choose "
                "another run.output_dir"
            )
        for old in run_dir.iterdir():
            if old.name == LOCK_NAME:
                continue
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"config_path": config_path, "config": config_to_dict(config)}
    path = run_dir / "config.json"
    try:
        path.write_text(json.dumps(resolved, indent=2))
    except OSError as e:  # a full disk (a resume too): the path, not a bare [Errno 28]
        raise write_error("the resolved config", path, e) from e
    return run_dir


def prepare_data(config: Config) -> None:
    """Run the `data.prepare` hook (e.g. the demo's synthetic task) and check each dataset is
    one the loaders can read (a file, a `datasets` directory or a hub name)."""
    if config.data.prepare:
        import_object(config.data.prepare)(config.data)
    d = config.data
    paths = [(f"data.{k}", getattr(d, k)) for k in ("sft_path", "train_path", "eval_path")]
    for i, s in enumerate(d.sources):
        paths += [
            (f"data.sources[{i}].path", s.path),
            (f"data.sources[{i}].eval_path", s.eval_path),
        ]
    for key, path in paths:
        if path:
            try:
                source_kind(path)
            except DatasetError as e:
                raise DatasetError(f"{key} = {path!r}: {str(e).removeprefix(f'{path}: ')}") from e


def _fitting(
    items: list[PromptItem], where: str, config: Config, tokenizer: Any, model_dir: Path
) -> list[PromptItem]:
    """The prompts that fit the context: longer ones would fail every sample at generation, so
    they are dropped here, counted and printed."""
    limit = prompt_limit(model_dir, config.rollout.max_total_tokens)
    found = drop_overlong_prompts(items, lambda i: len(tokenize_prompt(tokenizer, i.prompt)), limit)
    if found.dropped:
        line = found.describe(where)
        if not found.kept:
            raise DatasetError(f"{line}: no prompt is left; shorten them or raise the limit")
        print(f"[train] {line}", flush=True)
    return found.kept


def load_rl_prompts(config: Config, key: str, tokenizer: Any, model_dir: Path) -> list[PromptItem]:
    """The prompts of `data.<key>` ("train_path" or "eval_path") that fit the context."""
    d = config.data
    path = getattr(d, key)
    split = d.train_split if key == "train_path" else d.eval_split
    items = load_prompts(
        path,
        d.prompt_key,
        d.label_key,
        d.messages_key,
        metadata_keys=d.metadata_keys,
        split=split,
        subset=d.subset,
        wrap=ChatWrap(user_template=d.user_template, system_prompt=d.system_prompt),
    )
    return _fitting(items, f"data.{key} = {path!r}", config, tokenizer, model_dir)


def load_source_prompts(
    config: Config, i: int, tokenizer: Any, model_dir: Path, *, held_out: bool, first_index: int
) -> list[PromptItem]:
    """The prompts of `data.sources[i]` (its `eval_path` when `held_out`) that fit the context,
    each tagged with the source's name; its columns default to the [data] ones."""
    d, s = config.data, config.data.sources[i]
    path = s.eval_path if held_out else s.path
    items = load_prompts(
        path,
        s.prompt_key or d.prompt_key,
        d.label_key if s.label_key is None else s.label_key,
        s.messages_key or d.messages_key,
        metadata_keys=s.metadata_keys or d.metadata_keys,
        split=s.eval_split if held_out else s.split,
        subset=s.subset,
        source=s.name,
        first_index=first_index,
        wrap=ChatWrap(
            user_template=d.user_template if s.user_template is None else s.user_template,
            system_prompt=d.system_prompt if s.system_prompt is None else s.system_prompt,
        ),
    )
    key = f"data.sources[{i}].{'eval_path' if held_out else 'path'} = {path!r}"
    return _fitting(items, key, config, tokenizer, model_dir)


def _corpus(config: Config) -> list[str]:
    if config.model.tiny.corpus_path:
        return Path(config.model.tiny.corpus_path).read_text().splitlines()
    lines: list[str] = []
    for key in ("sft_path", "train_path"):
        path = getattr(config.data, key)
        if path:
            lines += Path(path).read_text().splitlines()
    return lines


def prepare_base_model(config: Config) -> Path:
    """model.path as a local HF directory: converted from model.source (once, cached), a hub id
    ("org/name") downloaded to the HF cache, or built with the tiny-model kit when asked."""
    if config.model.source:
        return fetch_source(config.model.source, config.model.path or None)
    path = Path(config.model.path)
    if not config.model.path:
        raise ValueError(
            "model.path is empty: point it at an HF model directory, or set model.source"
        )
    tiny = config.model.tiny
    if (path / "config.json").is_file():
        if tiny.enabled:
            _check_tiny_model(path, tiny_spec(config))
        return path
    if not tiny.enabled and looks_like_hub_id(config.model.path):
        return download_hub_model(config.model.path)
    if not tiny.enabled:
        raise FileNotFoundError(
            f"model.path = {str(path)!r} is not an HF model directory (no config.json); "
            "set model.tiny.enabled = true to build a tiny model there"
        )
    corpus = _corpus(config) if tiny.tokenizer == "bpe" else []
    print(f"[train] building a tiny model in {path}", flush=True)
    return make_tiny_model(path, tiny_spec(config), corpus)


def tiny_spec(config: Config) -> TinyModelSpec:
    """The TinyModelSpec `[model.tiny]` asks for."""
    tiny = config.model.tiny
    return TinyModelSpec(
        tokenizer=tiny.tokenizer,
        vocab_size=tiny.vocab_size,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_embeddings=tiny.tie_embeddings,
        seed=tiny.seed,
    )


def _check_tiny_model(path: Path, spec: TinyModelSpec) -> None:
    """A tiny model built earlier at `path` from other `[model.tiny]` values is an error (it
    would be trained silently in place of the one the config asks for)."""
    diff = spec_differences(path, spec)
    if diff:
        keys = ", ".join(
            f"model.tiny.{k} = {asked!r} (built: {built!r})" for k, (built, asked) in diff.items()
        )
        raise ValueError(
            f"model.path = {str(path)!r} holds a tiny model built from other [model.tiny] "
            f"values: {keys}. Delete the directory to rebuild it, or point model.path elsewhere"
        )


def with_response_text(reward_fn: Any, tokenizer: Any) -> Any:
    """Wrap a reward function so each sample carries `metadata['response_text']` (decoded).

    The wrapper is sync for a sync function and async for an async one, so the time-bounded
    scorer (`rollouts.rewards.scoring`) still runs a sync one in an abandonable worker thread.
    """

    decode = response_decoder(tokenizer)

    def with_text(sample: Any) -> Any:
        if "response_text" in sample.metadata:
            return sample
        text = decode(sample.response_tokens)
        return dataclasses.replace(sample, metadata={**sample.metadata, "response_text": text})

    if is_async_callable(reward_fn):

        async def reward(sample: Any) -> Any:
            return await reward_fn(with_text(sample))

    else:

        def reward(sample: Any) -> Any:
            return reward_fn(with_text(sample))

    reward.__wrapped__ = reward_fn  # type: ignore[attr-defined]  # errors name the user's function
    return reward


def make_logger(
    config: Config,
    path: Path,
    total: int,
    prefix: str,
    resume_step: int | None,
    trainer_pid: int | None = None,
) -> MetricsLogger:
    """metrics file + console (+ TensorBoard / wandb when the config asks); every step also
    logs the driver's RSS (and the trainer process's, `trainer_pid`) and warns on steady growth."""
    sinks: list[Any] = [JsonlSink(path, resume_step)]
    if config.logging.console:
        sinks.append(ConsoleSink(total, prefix))
    if config.logging.tensorboard:
        from rollouts.driver.metrics import TensorBoardSink

        sinks.append(TensorBoardSink(path.parent / "tensorboard"))
    if config.logging.wandb:
        from rollouts.config import config_to_dict
        from rollouts.driver.metrics import WandbSink

        log = config.logging
        sinks.append(
            WandbSink(
                log.wandb_project,
                config.run.name,
                path.parent,
                log.wandb_mode,
                config_to_dict(config),
            )
        )
    rl = prefix.startswith("rl")
    rollouts_path = path.parent / ROLLOUTS if rl else None
    eval_path = path.parent / EVAL_ROLLOUTS if rl else None
    for p in (rollouts_path, eval_path):
        if p is not None and resume_step is not None:
            truncate_jsonl(p, resume_step)
        elif p is not None and p.exists():
            p.unlink()
    processes = {"driver": os.getpid()}
    if trainer_pid is not None:
        processes["trainer"] = trainer_pid
    watch = MemoryWatch(processes=processes)
    return MetricsLogger(sinks, rollouts_path, probes=[watch], eval_path=eval_path)
