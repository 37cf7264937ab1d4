"""The driver behind train.py: builds every object once and runs SFT, RL, or SFT then RL.

    prepare run dir, data, base model
      -> SFT (backend, conversations)            -> checkpoints/sft/step_N/model
      -> engines on that model (built-in processes, or SGLang / vLLM URLs) + EnginePool
      -> RL (backend, DataBuffer, AsyncRolloutManager, hooks: checkpoint, weight sync, eval)
      -> engines stopped (also on Ctrl-C or an error)

Resume (`--resume`): each phase continues from its latest complete checkpoint, with the
DataBuffer (order, epoch, partial groups), RNG, optimizer, schedule, step and weight version.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import trio

from rollouts.config import Config
from rollouts.data.buffer import DataBuffer
from rollouts.data.limits import sft_limit
from rollouts.data.loaders import load_conversations
from rollouts.driver.engines import cpu_share, open_engines
from rollouts.driver.evaluation import EvalSpec, evaluate
from rollouts.driver.lock import hold_run_locks
from rollouts.driver.metrics import last_step
from rollouts.driver.placement import cpu_plan, decide_trainer_process, pinned
from rollouts.driver.setup import (
    RL_METRICS,
    SFT_METRICS,
    StopFlag,
    load_rl_prompts,
    make_logger,
    prepare_base_model,
    prepare_data,
    prepare_run_dir,
    watch_signals,
    with_response_text,
)
from rollouts.driver.summary import finish_run, quiet_progress_bars
from rollouts.inference.pool import EnginePool
from rollouts.loop.rl import RLHooks, run_rl_training
from rollouts.loop.sft import run_sft_training, split_eval, tokenize_all, total_sft_steps
from rollouts.plugins import load_function
from rollouts.rewards.protocol import RewardFn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.trainer.checkpoint import (
    BestSpec,
    clean_leftovers,
    find_latest_checkpoint,
    load_checkpoint,
    load_reference_params,
    save_checkpoint,
)
from rollouts.trainer.factories import create_backend, load_tokenizer, resolve_device
from rollouts.trainer.process import TrainerProcess
from rollouts.trainer.pytorch import MODEL_DIR
from rollouts.weights.check import (
    WeightProbe,
    check_engines_at_start,
    content_probe,
    probe_metrics,
)
from rollouts.weights.disk import (
    clean_sync_root,
    publish_weights,
    run_sync_root,
    sync_pool,
)
from rollouts.weights.distributed_pool import distributed_sync_for, sync_pool_distributed

JSON_SCALAR = (int, float, str, bool)  # what a checkpoint stores of a step's metrics


def checkpoint_root(config: Config, run_dir: Path, phase: str) -> Path:
    return Path(config.checkpoint.dir or run_dir / "checkpoints") / phase


async def _save(
    backend: Any,
    root: Path,
    step: int,
    version: str,
    extra: dict,
    keep: int,
    metrics: Any = None,
    best: BestSpec | None = None,
    reference: Any = None,
) -> None:
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


async def sft_phase(
    config: Config,
    run_dir: Path,
    base: Path,
    resume: bool,
    stop: StopFlag,
    make_backend: Any = create_backend,
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
                await _save(backend, root, step, f"sft-{step}", {"phase": "sft"}, keep)

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


def _eval_hook(
    config: Config, pool: Any, tokenizer: Any, reward_fn: Any, manager: Any, items: list[Any]
) -> Any:
    """The held-out greedy evaluation of `items` through the engines (None when there are none)."""
    if not items:
        return None
    items = items[: config.data.eval_size or None]
    r = config.rollout
    spec = EvalSpec(
        max_new_tokens=r.sampling.max_new_tokens,
        stop=tuple(r.sampling.stop),
        max_total_tokens=r.max_total_tokens,
        max_turns=r.max_turns,
        env_factory=manager.env_factory,
        generate_fn=manager.generate_fn,
        reward_timeout_s=r.reward_timeout_s,
    )

    async def run_eval() -> dict[str, float]:
        result = await evaluate(pool, tokenizer, items, reward_fn, spec)
        return result.metrics("eval")

    return run_eval


async def rl_phase(
    config: Config,
    run_dir: Path,
    model_dir: Path,
    resume: bool,
    stop: StopFlag,
    reward_fn: Any = None,
    make_backend: Any = create_backend,
) -> dict[str, float]:
    """RL from `model_dir` (or from the latest RL checkpoint); returns the last step's metrics."""
    root = checkpoint_root(config, run_dir, "rl")
    clean_leftovers(root)
    latest = find_latest_checkpoint(root) if resume else None
    tokenizer = load_tokenizer(model_dir)
    d = config.data
    buffer = DataBuffer(
        load_rl_prompts(config, "train_path", tokenizer, model_dir),
        seed=config.run.seed,
        shuffle=d.shuffle,
    )
    eval_items = load_rl_prompts(config, "eval_path", tokenizer, model_dir) if d.eval_path else []
    if reward_fn is None and not config.rollout.reward_fn:
        raise ValueError("rollout.reward_fn is empty: name a reward function by dotted path")
    reward = load_function(reward_fn or config.rollout.reward_fn, RewardFn)
    reward_fn = with_response_text(reward, tokenizer)
    plan = cpu_plan(config)
    host = None
    decision = decide_trainer_process(
        config, plan, custom_backend=make_backend is not create_backend
    )
    if decision.own_process:
        host = TrainerProcess(
            threads=torch.get_num_threads(), other_cores=plan.driver if plan is not None else ()
        )
        make_backend = host.create
    print(f"[train] {decision.describe(host.pid if host is not None else None)}", flush=True)
    backend = ref = None
    try:
        backend = make_backend(config, model_path=model_dir, total_steps=config.training.rl_steps)
        if plan is not None:
            print(f"[train] CPU placement: {plan.describe()}", flush=True)
            _pin_training_thread(backend, plan.trainer)
        start, version, step_metrics, loop_state = 0, 0, None, {}
        if latest is not None:
            state = await trio.to_thread.run_sync(load_checkpoint, backend, latest)
            buffer.load_state_dict(state.extra_state["data_buffer"])
            start, version = state.step, int(state.weight_version)
            loop_state = state.extra_state.get("rl_loop", {})
            step_metrics = state.extra_state.get("metrics")
        ref = build_reference(config, model_dir, make_backend)
        if ref is not None and plan is not None:
            _pin_training_thread(ref.backend, plan.trainer)
        if ref is not None and latest is not None:
            await trio.to_thread.run_sync(restore_reference, ref, latest)
        engine_model = latest / MODEL_DIR if latest is not None else model_dir
        # the engines reload only from the starting model and the run's weight copies
        sync_root = run_sync_root(config.weight_sync.dir, config.run.name, run_dir)
        configured = bool(config.weight_sync.dir)
        await trio.to_thread.run_sync(clean_sync_root, sync_root, configured)
        if config.engines.kind != "builtin":  # servers already up reload the starting weights
            # in place: the trainer writes them, so every tensor is in the files (a tied head)
            engine_model = await trio.to_thread.run_sync(
                publish_weights, backend, sync_root, str(version)
            )
        async with open_engines(
            config,
            engine_model,
            str(version),
            (engine_model, sync_root),
            cpus_per_engine=plan.engines if plan is not None else (),
        ) as pool:
            with pinned(plan.driver if plan is not None else ()):
                return await _rl_with_engines(
                    config,
                    run_dir,
                    backend,
                    buffer,
                    pool,
                    tokenizer,
                    reward_fn,
                    ref,
                    (start, version, step_metrics),
                    stop,
                    loop_state=loop_state,
                    eval_items=eval_items,
                    trainer_pid=host.pid if host is not None else None,
                )
    finally:
        if backend is not None:
            backend.close()
        if ref is not None:
            ref.backend.close()
        if host is not None:
            host.close()


def _pin_training_thread(backend: Any, cores: tuple[int, ...]) -> None:
    """The one-process backend's training thread on `cores` (other backends: not pinned)."""
    if hasattr(backend, "pin_thread"):
        backend.pin_thread(cores)


def build_reference(config: Config, model_dir: Path, make_backend: Any = create_backend) -> Any:
    """A reference model when the algorithm (or its schedule) can use KL; else None."""
    from rollouts.loop.rl import ReferencePolicy

    a = config.algorithm
    if a.kl_coef <= 0.0 and not a.schedule and a.policy_loss != "pairwise":
        return None
    return ReferencePolicy(
        make_backend(config, model_path=model_dir, total_steps=1, value_head=False)
    )


def restore_reference(ref: Any, checkpoint: Path) -> bool:
    """Load the reference parameters `checkpoint` saved into `ref` (True), or leave it on the
    base model when the checkpoint saved none (it had not moved yet)."""
    saved = load_reference_params(checkpoint)
    if saved is None:
        return False
    ref.restore(saved)
    print(f"[train] reference model restored from {checkpoint}", flush=True)
    return True


async def _rl_with_engines(
    config: Config,
    run_dir: Path,
    backend: Any,
    buffer: DataBuffer,
    pool: EnginePool,
    tokenizer: Any,
    reward_fn: Any,
    ref: Any,
    resumed: tuple[int, int, dict[str, Any] | None],
    stop: StopFlag,
    loop_state: dict[str, Any] | None = None,
    eval_items: list[Any] | None = None,
    trainer_pid: int | None = None,
) -> dict[str, float]:
    """RL with the engines up; `resumed` = (step, weight version, that step's stored metrics)."""
    root = checkpoint_root(config, run_dir, "rl")
    total = config.training.rl_steps
    start, version, step_metrics = resumed
    resume_step = start if start else None
    logger = make_logger(config, run_dir / RL_METRICS, total, "rl ", resume_step, trainer_pid)
    last = last_step(run_dir / RL_METRICS)
    if start and step_metrics and (last is None or last < start):  # killed after the checkpoint
        logger.log(start, step_metrics)  # and before its line: the line comes from the checkpoint
    manager = AsyncRolloutManager(
        buffer,
        config.rollout,
        pool,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        seed=config.run.seed,  # sampling seeds of every request (reproducible runs)
    )
    evaluate_fn = _eval_hook(config, pool, tokenizer, reward_fn, manager, eval_items or [])
    # weights-only copies for the engines (in /dev/shm when there is one); one root per run,
    # cleaned at start (a crashed run's copies: `rl_phase`) and on exit
    configured = bool(config.weight_sync.dir)
    sync_root = run_sync_root(config.weight_sync.dir, config.run.name, run_dir)

    async def checkpoint(
        step: int,
        version: str,
        buffer_state: dict[str, Any],
        metrics: Any = None,
        loop_state: dict[str, Any] | None = None,
    ) -> None:
        # the step's metrics too: a kill between the checkpoint and its metrics line loses none
        extra = {
            "phase": "rl",
            "data_buffer": buffer_state,
            "rl_loop": loop_state or {},
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, JSON_SCALAR)},
        }
        c = config.checkpoint
        best = BestSpec(metric=c.best_metric, mode=c.best_mode) if c.best_metric else None
        reference = ref.params_to_checkpoint() if ref is not None else None
        await _save(backend, root, step, version, extra, c.keep_last, metrics, best, reference)

    distributed = distributed_sync_for(config)  # None for weight_sync.method = "disk"
    pause_mode = "keep" if config.rollout.mode == "async" else "abort"
    probe_of = content_probe(config, backend, tokenizer)
    if probe_of is not None:  # the engines must serve the starting weights before any step
        live = [e for e, up in zip(pool.engines, pool.up, strict=True) if up]
        await check_engines_at_start(live, await probe_of(str(version)))

    async def sync(version: str) -> dict[str, float]:
        probe = await probe_of(version) if probe_of is not None else None
        if distributed is not None:
            report = await sync_pool_distributed(
                pool,
                distributed,
                backend.get_weights,
                version,
                pause_mode=pause_mode,
                step=int(version),
                probe=probe,
            )
            return report.metrics() | probe_metrics(probe)
        path = await trio.to_thread.run_sync(publish_weights, backend, sync_root, version)
        return await deliver_to_engines(path, version, probe)

    async def deliver_to_engines(
        path: Path, version: str, probe: WeightProbe | None
    ) -> dict[str, float]:
        report = await sync_pool(
            pool,
            path,
            version,
            attempts=config.weight_sync.attempts,
            pause_mode=pause_mode,
            probe=probe,
        )
        return report.metrics() | probe_metrics(probe)

    async def publish(version: str) -> Callable[[], Awaitable[dict[str, float]]]:
        """Fix the version's weights now (the next optimizer step must not change them); write
        and load them in `deliver`, beside the next step. A one-process (or trainer-process)
        backend takes a snapshot (`snapshot_weights`, in order after this step's update) that
        another thread writes; others write their files now."""
        if not hasattr(backend, "write_weights"):
            probe = await probe_of(version) if probe_of is not None else None
            path = await trio.to_thread.run_sync(publish_weights, backend, sync_root, version)
            return functools.partial(deliver_to_engines, path, version, probe)
        weights = await trio.to_thread.run_sync(backend.snapshot_weights)
        probe = await probe_of(version) if probe_of is not None else None  # of the snapshot

        async def deliver() -> dict[str, float]:
            path = await trio.to_thread.run_sync(
                functools.partial(publish_weights, backend, sync_root, version, weights=weights)
            )
            return await deliver_to_engines(path, version, probe)

        return deliver

    def log_samples(step: int, batch: Any) -> None:
        n = config.logging.rollouts_per_step
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        logger.log_samples(step, batch.samples[:n], decode)

    hooks = RLHooks(
        checkpoint=checkpoint,
        sync_weights=sync,
        publish_weights=publish if distributed is None else None,
        evaluate=evaluate_fn,
        should_stop=stop,
        log_samples=log_samples,
    )
    if start == 0 and evaluate_fn is not None:
        before = await evaluate_fn()
        logger.log(0, before)
        print(f"[train] held-out accuracy before RL: {before['eval/accuracy']:.3f}", flush=True)
    try:
        result = await run_rl_training(
            backend,
            buffer,
            manager,
            pool,
            config,
            logger,
            hooks=hooks,
            reward_fn=reward_fn,
            ref=ref,
            start_step=start,
            start_version=version,
            loop_state=loop_state,
        )
    finally:
        logger.close()
        if distributed is not None:
            with trio.CancelScope(shield=True):
                await distributed.close(pool.engines)
        clean_sync_root(sync_root, configured)
    acc = result.last_metrics.get("eval/accuracy")
    if acc is not None:
        print(f"[train] held-out accuracy after RL: {acc:.3f} (step {result.steps})", flush=True)
    return result.last_metrics


async def _main(
    mode: str, config: Config, resume: bool, config_path: str, make_backend: Any
) -> int:
    with hold_run_locks(config):  # one run per directory, for the run's life
        return await _run(mode, config, resume, config_path, make_backend)


async def _run(mode: str, config: Config, resume: bool, config_path: str, make_backend: Any) -> int:
    started = time.monotonic()
    e = config.engines
    on_cpu = resolve_device(config.training.device).type == "cpu" and e.kind == "builtin"
    threads = cpu_share(
        config.training.torch_threads, "cpu" if on_cpu else "gpu", e.builtin.num_engines
    )
    if threads:
        torch.set_num_threads(threads)
    run_dir = prepare_run_dir(config, config_path, resume)
    prepare_data(config)
    model_dir = prepare_base_model(config)
    stop = StopFlag()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_signals, stop, nursery.cancel_scope)
        if mode in ("sft", "sft+rl"):
            model_dir = await sft_phase(config, run_dir, model_dir, resume, stop, make_backend)
            print(f"[train] SFT model: {model_dir}", flush=True)
        if mode in ("rl", "sft+rl") and not stop():
            await rl_phase(config, run_dir, model_dir, resume, stop, make_backend=make_backend)
        nursery.cancel_scope.cancel()
    if stop():
        print(f"[train] stopped by signal; resume with --resume (run dir {run_dir})", flush=True)
        return 130
    phase = "rl" if mode in ("rl", "sft+rl") else "sft"
    last = find_latest_checkpoint(checkpoint_root(config, run_dir, phase))
    finish_run(run_dir, time.monotonic() - started, last)
    return 0


def run_training(mode: str, config: Config, *, resume: bool = False, config_path: str = "") -> int:
    """Run `mode` ("sft", "rl" or "sft+rl") for `config`; the process exit code.

    Under torchrun with several ranks (the FSDP backend), rank 0 runs the driver and the other
    ranks mirror its backend calls (`backends/mirror.py`).
    """
    quiet_progress_bars()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return trio.run(_main, mode, config, resume, config_path, create_backend)
    from rollouts.trainer.mirror import BackendHub

    if config.training.backend != "fsdp":
        raise ValueError("several torchrun ranks need training.backend = 'fsdp'")
    hub = BackendHub()
    if hub.rank != 0:
        hub.follow()
        return 0
    try:
        return trio.run(_main, mode, config, resume, config_path, hub.create)
    finally:
        hub.shutdown()
