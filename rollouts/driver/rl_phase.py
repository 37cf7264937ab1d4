"""The RL phase of a run: build the trainer, the reference, the engines and the weight publisher
once, then hand them to the loop (`rollouts/loop/rl.py`).

    trainer (here or in its own process) -> resume state -> reference model
      -> the engines' starting weights -> engines up (EnginePool), and the teacher's when
         distilling, the judge's when it is the reward (`served.py`: a teacher's tokenizer
         checked before anything starts)
      -> manager, evaluation, checkpoint hook -> WeightPublisher (chosen once)
      -> run_rl_training -> engines stopped, weight copies removed (also on an error)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
import trio

from rollouts.config import Config
from rollouts.config.loader import JUDGE_REWARD
from rollouts.config.rollout import resolved_concurrency
from rollouts.data.buffer import DataBuffer, MixtureSource
from rollouts.driver.engines import cpu_beside_engines, cpu_share, open_engines
from rollouts.driver.failures import BatchReporter
from rollouts.driver.metrics import MetricsLogger, last_step
from rollouts.driver.placement import CpuPlan, cpu_plan, decide_trainer_process, pinned
from rollouts.driver.reference_setup import open_reference
from rollouts.driver.resume import checkpoint_to_resume
from rollouts.driver.rl_run import Resumed, RLRun, eval_hook, evaluate_teacher
from rollouts.driver.served import check_tokenizers, open_judge, open_teacher, served_model_dir
from rollouts.driver.setup import (
    RL_METRICS,
    StopFlag,
    load_rl_prompts,
    load_source_prompts,
    make_logger,
    with_response_text,
)
from rollouts.driver.summary import eval_failures_note
from rollouts.driver.trainer_io import BackendFactory, checkpoint_root, save
from rollouts.engine_kinds import engine_kind
from rollouts.gateway import open_agent_generate
from rollouts.gcpolicy import freeze_startup_objects
from rollouts.loop.batch_files import batch_writer
from rollouts.loop.rl import RLHooks, run_rl_training
from rollouts.rewards.named import load_reward_fn
from rollouts.rewards.protocol import RewardFn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.trainer.checkpoint import (
    BestSpec,
    clean_leftovers,
    load_checkpoint,
)
from rollouts.trainer.factories import create_backend, load_tokenizer
from rollouts.trainer.process import TrainerProcess
from rollouts.trainer.protocol import TrainingBackend
from rollouts.trainer.pytorch import MODEL_DIR
from rollouts.types import PromptItem
from rollouts.weights.copies import clean_sync_root, run_sync_root
from rollouts.weights.files import publish_weights
from rollouts.weights.publisher import open_publisher

JSON_SCALAR = (int, float, str, bool)  # what a checkpoint stores of a step's metrics


async def rl_phase(
    config: Config,
    run_dir: Path,
    model_dir: Path,
    resume: bool,
    stop: StopFlag,
    reward_fn: Any = None,
    make_backend: BackendFactory | None = None,
    resume_step: int | None = None,
) -> dict[str, float]:
    """RL from `model_dir` (or from the latest RL checkpoint, verified: `resume.py`; step
    `resume_step` when given); returns the last step's metrics.

    `make_backend`: None builds the trainer as `training.backend` says, here or in a trainer
    process (`placement.decide_trainer_process`); a factory (torchrun's, a test's) as it is.
    """
    root = checkpoint_root(config, run_dir, "rl")
    clean_leftovers(root)
    latest = await checkpoint_to_resume(config, root, "rl", resume=resume, step=resume_step)
    tokenizer = load_tokenizer(model_dir)
    buffer, eval_items, reward = _rl_inputs(config, tokenizer, model_dir, reward_fn)
    plan = cpu_plan(config)
    _set_trainer_threads(config, plan)
    host = _trainer_host(config, plan, custom_backend=make_backend is not None)
    make = host.create if host is not None else make_backend or create_backend
    backend = ref = None
    try:
        backend = _policy_backend(config, make, model_dir, plan)
        resumed = await _resume(backend, buffer, latest)
        ref = await open_reference(config, model_dir, make, plan, latest, backend)
        start = _engines_start_weights(config, run_dir, backend, model_dir, latest, resumed.version)
        sync_root, engine_model = await start
        roots = (engine_model, sync_root)
        async with (
            open_engines(config, engine_model, str(resumed.version), roots, plan=plan) as pool,
            open_teacher(config, tokenizer) as teacher,
            open_judge(config) as judge,
        ):
            with pinned(plan.driver if plan is not None else ()):
                run = RLRun(
                    config=config,
                    run_dir=run_dir,
                    backend=backend,
                    buffer=buffer,
                    pool=pool,
                    tokenizer=tokenizer,
                    reward_fn=reward if judge is None else with_response_text(judge, tokenizer),
                    ref=ref,
                    resumed=resumed,
                    stop=stop,
                    eval_items=eval_items,
                    sync_root=sync_root,
                    trainer_pid=host.pid if host is not None else None,
                    teacher=teacher,
                )
                return await _rl_with_engines(run)
    finally:
        for opened in (backend, ref.backend if ref is not None else None, host):
            if opened is not None:
                opened.close()


def _policy_backend(
    config: Config, make: BackendFactory, model_dir: Path, plan: CpuPlan | None
) -> TrainingBackend:
    """The trained policy, its training thread on the plan's cores (the plan printed)."""
    backend = make(config, model_path=model_dir, total_steps=config.training.rl_steps)
    if plan is not None:
        print(f"[train] CPU placement: {plan.describe()}", flush=True)
        if plan.trainer:
            backend.pin_thread(plan.trainer)
    return backend


def _rl_inputs(
    config: Config, tokenizer: Any, model_dir: Path, reward_fn: Any
) -> tuple[DataBuffer, list[PromptItem], RewardFn | None]:
    """The prompts (a DataBuffer), the held-out prompts and the reward function (None: the
    judge, made once its engines are up); a teacher whose tokenizer is not the student's is
    refused here, before anything starts."""
    if config.teacher.enabled:
        check_tokenizers(tokenizer, served_model_dir(config.teacher))
    buffer, eval_items = _prompts(config, tokenizer, model_dir)
    if reward_fn is None and not config.rollout.reward_fn:
        raise ValueError("rollout.reward_fn is empty: name a reward function by dotted path")
    if reward_fn is None and config.rollout.reward_fn == JUDGE_REWARD:
        return buffer, eval_items, None  # the [judge], once its engines are up
    reward = load_reward_fn(reward_fn or config.rollout.reward_fn)
    return buffer, eval_items, with_response_text(reward, tokenizer)


def _prompts(
    config: Config, tokenizer: Any, model_dir: Path
) -> tuple[DataBuffer, list[PromptItem]]:
    """The training prompts (one dataset, or a mixture of [[data.sources]]) and the held-out
    ones (a mixture's: each source's `eval_path`, tagged with its name)."""
    d = config.data
    if not d.sources:
        items = load_rl_prompts(config, "train_path", tokenizer, model_dir)
        held_out = load_rl_prompts(config, "eval_path", tokenizer, model_dir) if d.eval_path else []
        held_out = held_out[: d.eval_size or None]
        return DataBuffer(items, seed=config.run.seed, shuffle=d.shuffle), held_out
    sources: list[MixtureSource] = []
    eval_items: list[PromptItem] = []
    for i, s in enumerate(d.sources):
        first = sum(len(src.items) for src in sources)
        items = load_source_prompts(
            config, i, tokenizer, model_dir, held_out=False, first_index=first
        )
        sources.append(MixtureSource(name=s.name, items=tuple(items), weight=s.weight))
        if s.eval_path:
            held_out = load_source_prompts(
                config, i, tokenizer, model_dir, held_out=True, first_index=len(eval_items)
            )
            eval_items += held_out[: d.eval_size or None]  # per source
    return DataBuffer.mixture(sources, seed=config.run.seed, shuffle=d.shuffle), eval_items


def _trainer_host(
    config: Config, plan: CpuPlan | None, *, custom_backend: bool
) -> TrainerProcess | None:
    """A trainer process when placement decides on one; the decision and its reason printed."""
    decision = decide_trainer_process(config, plan, custom_backend=custom_backend)
    host = None
    if decision.own_process:
        other_cores = plan.driver if plan is not None else ()
        host = TrainerProcess(threads=torch.get_num_threads(), other_cores=other_cores)
    print(f"[train] {decision.describe(host.pid if host is not None else None)}", flush=True)
    return host


def _set_trainer_threads(config: Config, plan: CpuPlan | None) -> None:
    """The RL trainer's torch threads (this process's, and a trainer process's): the plan's, or
    a share of the cores beside the built-in engines on CPU (`engines.cpu_share`)."""
    if plan is not None:
        torch.set_num_threads(plan.trainer_threads)
        return
    device = "cpu" if cpu_beside_engines(config) else "gpu"
    threads = cpu_share(config.training.torch_threads, device, config.engines.builtin.num_engines)
    if threads:
        torch.set_num_threads(threads)


async def _resume(backend: TrainingBackend, buffer: DataBuffer, latest: Path | None) -> Resumed:
    """Load the latest checkpoint into the backend and the buffer (nothing for a new run)."""
    if latest is None:
        return Resumed()
    state = await trio.to_thread.run_sync(load_checkpoint, backend, latest)
    buffer.load_state_dict(state.extra_state["data_buffer"])
    return Resumed(
        step=state.step,
        version=int(state.weight_version),
        metrics=state.extra_state.get("metrics"),
        loop_state=state.extra_state.get("rl_loop", {}),
    )


async def _engines_start_weights(
    config: Config,
    run_dir: Path,
    backend: TrainingBackend,
    model_dir: Path,
    latest: Path | None,
    version: int,
) -> tuple[Path, Path]:
    """The run's weight-copy root (cleaned of a crashed run's copies) and the model the engines
    start on: the checkpoint's (or the starting) model; servers already up reload it in place,
    so the trainer writes it there with every tensor in the files (a tied head too).

    LoRA: with adapter sync the engines serve the base model (servers already up reload it,
    written out with every tensor; the publisher's `check_start` gives them the adapter);
    merged, a resumed run's engines start on the merged weights."""
    lora = config.model.lora.enabled
    engine_model = latest / MODEL_DIR if latest is not None and not lora else model_dir
    sync_root = run_sync_root(config.weight_sync.dir, config.run.name, run_dir)
    configured = bool(config.weight_sync.dir)
    await trio.to_thread.run_sync(clean_sync_root, sync_root, configured)
    adapters = backend.lora_adapters() if config.weight_sync.lora == "adapter" else None
    here = engine_kind(config.engines.kind).started_here  # they start on our files
    if adapters is not None and here:
        return sync_root, model_dir
    if adapters is not None:
        base = sync_root / "v_base"
        await trio.to_thread.run_sync(lambda: adapters.save_base_weights(base).result())
        return sync_root, base
    if not here or (lora and latest is not None):
        engine_model = await trio.to_thread.run_sync(
            publish_weights, backend, sync_root, str(version)
        )
    return sync_root, engine_model


async def _rl_with_engines(run: RLRun) -> dict[str, float]:
    """RL with the engines up: the manager (behind the gateway when asked), then the rest."""
    config = run.config
    logger = _rl_logger(run)
    rollout = dataclasses.replace(
        config.rollout, max_concurrency=resolved_concurrency(config.rollout, config.engines)
    )
    async with open_agent_generate(rollout) as agent_fn:  # None unless the gateway is asked for
        manager = AsyncRolloutManager(
            run.buffer,
            rollout,
            run.pool,
            tokenizer=run.tokenizer,
            generate_fn=agent_fn,
            reward_fn=run.reward_fn,
            seed=config.run.seed,  # sampling seeds of every request (reproducible runs)
            reward_shaping=config.reward,  # a batch's rewards are final when it leaves it
            teacher=run.teacher,
        )
        return await _rl_with_manager(run, manager, logger)


async def _rl_with_manager(
    run: RLRun, manager: AsyncRolloutManager, logger: MetricsLogger
) -> dict[str, float]:
    """The hooks and the publisher around the manager, then the loop."""
    config, r = run.config, run.resumed
    evaluate_fn = eval_hook(run, manager, logger)
    hooks = RLHooks(
        checkpoint=functools.partial(_checkpoint, run),
        evaluate=evaluate_fn,
        should_stop=run.stop,
        report_batch=BatchReporter(
            logger=logger,
            decode=functools.partial(run.tokenizer.decode, skip_special_tokens=True),
            rows_per_step=config.logging.rollouts_per_step,
        ),
    )
    async with open_publisher(config, run.backend, run.pool, run.tokenizer, run.sync_root) as w:
        await w.check_start(str(r.version))  # the engines serve the starting weights
        freeze_startup_objects()  # full collections then skip what the set-up built
        if r.step == 0 and evaluate_fn is not None:
            teacher = await evaluate_teacher(run, manager)
            before = await evaluate_fn(0) | teacher
            logger.log(0, before)
            accuracy, note = before["eval/accuracy"], eval_failures_note(before)
            print(f"[train] held-out accuracy before RL: {accuracy:.3f}{note}", flush=True)
        try:
            result = await run_rl_training(
                run.backend,
                run.buffer,
                manager,
                run.pool,
                config,
                logger,
                weights=w,
                hooks=hooks,
                reward_fn=run.reward_fn,
                ref=run.ref,
                start_step=r.step,
                start_version=r.version,
                loop_state=r.loop_state,
                save_batches=batch_writer(config, run.run_dir, r.step),
            )
        finally:
            logger.close()
    acc, note = result.last_metrics.get("eval/accuracy"), eval_failures_note(result.last_metrics)
    if acc is not None:
        after = f"{acc:.3f} (step {result.steps}){note}"
        print(f"[train] held-out accuracy after RL: {after}", flush=True)
    return result.last_metrics


def _rl_logger(run: RLRun) -> MetricsLogger:
    """metrics.jsonl (cut back to the resumed step), with the checkpointed step's line written
    again when the run was killed after the checkpoint and before its line."""
    r, path = run.resumed, run.run_dir / RL_METRICS
    total = run.config.training.rl_steps
    logger = make_logger(run.config, path, total, "rl ", r.step or None, run.trainer_pid)
    last = last_step(path)
    if r.step and r.metrics and (last is None or last < r.step):
        logger.log(r.step, r.metrics)
    return logger


async def _checkpoint(
    run: RLRun,
    step: int,
    version: str,
    buffer_state: dict[str, Any],
    metrics: Any = None,
    loop_state: dict[str, Any] | None = None,
) -> None:
    """The loop's checkpoint hook: the trainer's state, the buffer's, the loop's and the step's
    metrics (a kill between the checkpoint and its metrics line loses none)."""
    states = (buffer_state, metrics, loop_state)
    await write_rl_checkpoint(run.config, run.run_dir, run.backend, run.ref, step, version, states)


async def write_rl_checkpoint(
    config: Config,
    run_dir: Path,
    backend: TrainingBackend,
    ref: Any,
    step: int,
    version: str,
    states: tuple[dict[str, Any], Any, dict[str, Any] | None],
) -> None:
    """RL checkpoint `step`: the backend's state, the reference's (if it moves), and `states`:
    where the prompts come from (the buffer's, or a replay's), the step's metrics and the
    loop's state."""
    buffer_state, metrics, loop_state = states
    extra = {
        "phase": "rl",
        "data_buffer": buffer_state,
        "rl_loop": loop_state or {},
        "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, JSON_SCALAR)},
    }
    c = config.checkpoint
    best = BestSpec(metric=c.best_metric, mode=c.best_mode) if c.best_metric else None
    reference = ref.params_to_checkpoint() if ref is not None else None
    root = checkpoint_root(config, run_dir, "rl")
    await save(backend, root, step, version, extra, c.keep_last, metrics, best, reference)
