"""The frozen configuration tree, read from TOML.

Every section is a frozen dataclass; `load_config` walks the TOML table against the dataclass
fields and collects EVERY problem (unknown key with a "did you mean", wrong type, out-of-range
value) into one `ConfigError` that names the key path and the fix. Range checks live in each
section's `problems()` so that a config built in code is checked the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """One or more problems in a configuration, each naming its key path and the fix."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} config problem(s){where}:\n{lines}")


def _check(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def _one_of(problems: list[str], key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(problems, value in allowed, f"{key} = {value!r}: must be one of {list(allowed)}")


class _Section:
    """Mixin: run `problems()` at construction, so no invalid section can exist."""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ConfigError(found)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunSection(_Section):
    """[run]: naming, output and seeding of a run."""

    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 0
    overwrite: bool = False  # a fresh (not --resume) run may replace an earlier run's directory


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelConfig(_Section):
    """[model.tiny]: build a tiny model with the tiny-model kit when `model.path` is missing."""

    enabled: bool = False
    tokenizer: str = "char"  # "char" | "bpe"
    vocab_size: int = 512  # BPE only
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    corpus_path: str = ""  # text the tokenizer is trained on ("" = the data files)

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "model.tiny.tokenizer", self.tokenizer, ("char", "bpe"))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _check(p, getattr(self, name) >= 1, f"model.tiny.{name}: must be >= 1")
        _check(
            p,
            self.hidden_size % max(self.num_heads, 1) == 0,
            f"model.tiny.hidden_size = {self.hidden_size}: must be divisible by num_heads",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(_Section):
    """[model]: which model to train and how to hold it."""

    path: str = ""
    tokenizer_path: str = ""  # "" = same as path
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _one_of(p, "model.attn_implementation", self.attn_implementation, ("sdpa", "eager"))
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig(_Section):
    """[data]: prompt and conversation datasets (JSONL)."""

    train_path: str = ""
    eval_path: str = ""
    sft_path: str = ""
    sft_eval_fraction: float = 0.05
    prompt_key: str = "prompt"
    label_key: str = "label"
    messages_key: str = "messages"
    shuffle: bool = True
    eval_size: int = 0  # 0 = the whole eval set
    prepare: str = ""  # dotted path to `fn(data_config) -> None` writing missing data files

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            0.0 <= self.sft_eval_fraction < 1.0,
            f"data.sft_eval_fraction = {self.sft_eval_fraction}: must be in [0, 1)",
        )
        _check(p, self.eval_size >= 0, f"data.eval_size = {self.eval_size}: must be >= 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig(_Section):
    """[rollout.sampling]: sampling parameters sent to the engines."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            self.max_new_tokens >= 1,
            f"rollout.sampling.max_new_tokens = {self.max_new_tokens}: must be >= 1",
        )
        _check(
            p,
            self.temperature >= 0.0,
            f"rollout.sampling.temperature = {self.temperature}: must be >= 0 (0 = greedy)",
        )
        _check(p, 0.0 < self.top_p <= 1.0, f"rollout.sampling.top_p = {self.top_p}: in (0, 1]")
        _check(p, self.top_k == -1 or self.top_k >= 1, "rollout.sampling.top_k: -1 or >= 1")
        _check(p, 0.0 <= self.min_p < 1.0, f"rollout.sampling.min_p = {self.min_p}: in [0, 1)")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig(_Section):
    """[rollout]: how batches of groups are generated, filtered and kept."""

    batch_size: int = 8  # groups (prompts) per training batch
    n_samples_per_prompt: int = 4
    over_sampling_factor: float = 1.5
    max_concurrency: int = 64
    max_over_sampling_rounds: int = 4
    on_short_batch: str = "warn"  # "warn" (train on a smaller batch) | "error"
    partial_rollouts: bool = True
    mask_off_policy_partial: bool = False
    filters: list[str] = dataclasses.field(default_factory=list)  # dotted paths or built-in names
    generate_fn: str = ""  # dotted path; "" = the engine pool
    reward_fn: str = ""  # dotted path
    env: str = ""  # dotted path or built-in env name; "" = single-turn
    max_turns: int = 1
    max_total_tokens: int = 1024
    generate_timeout_s: float = 300.0
    reward_timeout_s: float = 10.0
    mode: str = "sync"  # "sync" | "async"
    max_staleness: int = 1
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.batch_size >= 1, f"rollout.batch_size = {self.batch_size}: must be >= 1")
        _check(
            p,
            self.n_samples_per_prompt >= 1,
            f"rollout.n_samples_per_prompt = {self.n_samples_per_prompt}: must be >= 1",
        )
        _check(
            p,
            self.over_sampling_factor >= 1.0,
            f"rollout.over_sampling_factor = {self.over_sampling_factor}: must be >= 1.0",
        )
        _check(p, self.max_concurrency >= 1, "rollout.max_concurrency: must be >= 1")
        _check(
            p, self.max_over_sampling_rounds >= 1, "rollout.max_over_sampling_rounds: must be >= 1"
        )
        _one_of(p, "rollout.on_short_batch", self.on_short_batch, ("warn", "error"))
        _one_of(p, "rollout.mode", self.mode, ("sync", "async"))
        _check(p, self.max_turns >= 1, f"rollout.max_turns = {self.max_turns}: must be >= 1")
        _check(p, self.max_staleness >= 0, "rollout.max_staleness: must be >= 0")
        _check(p, self.generate_timeout_s > 0, "rollout.generate_timeout_s: must be > 0")
        _check(p, self.reward_timeout_s > 0, "rollout.reward_timeout_s: must be > 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EnginesConfig(_Section):
    """[engines]: the inference servers (built-in, SGLang or vLLM)."""

    kind: str = "builtin"  # "builtin" | "sglang" | "vllm"
    urls: list[str] = dataclasses.field(default_factory=list)  # for sglang / vllm
    num_engines: int = 1  # built-in engines to start
    max_batch: int = 64
    max_queue: int = 1024
    api_key: str = ""
    logprobs_from: str = "raw"  # "raw" logits | "scaled" (temperature-scaled)
    device: str = "cpu"
    torch_threads: int = 0  # built-in engines' torch threads; 0 = a share of the cores on CPU
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    health_interval_s: float = 5.0
    max_retries: int = 3

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "engines.kind", self.kind, ("builtin", "sglang", "vllm"))
        _one_of(p, "engines.logprobs_from", self.logprobs_from, ("raw", "scaled"))
        _check(p, self.num_engines >= 1, f"engines.num_engines = {self.num_engines}: must be >= 1")
        _check(p, self.max_batch >= 1, "engines.max_batch: must be >= 1")
        _check(p, self.max_queue >= 1, "engines.max_queue: must be >= 1")
        _check(p, self.max_retries >= 0, "engines.max_retries: must be >= 0")
        _check(p, self.torch_threads >= 0, "engines.torch_threads: must be >= 0 (0 = default)")
        _check(
            p,
            self.kind == "builtin" or bool(self.urls),
            f"engines.urls: must list the server URLs when engines.kind = {self.kind!r}",
        )
        return p


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "gae")
POLICY_LOSSES = ("ppo", "reinforce", "gspo", "pairwise")
PAIR_SELECTORS = ("best_vs_worst", "all_pairs_above_margin")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig(_Section):
    """[algorithm]: advantage estimator, policy loss, aggregation, KL and clip settings."""

    advantage: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss: str = "ppo"
    loss_agg: str = "token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"  # "loss" | "reward"
    tis: bool = False
    tis_cap: float = 2.0
    ref_update: str = "none"  # "none" | "copy" | "ema" | "periodic"
    ref_ema_decay: float = 0.99
    ref_update_every: int = 10
    gamma: float = 1.0
    lam: float = 1.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # groups per mini-batch; 0 = the whole batch
    pair_beta: float = 0.1  # policy_loss = "pairwise": beta of -log sigmoid(beta * margin)
    pair_selector: str = "best_vs_worst"  # | "all_pairs_above_margin" | dotted path to a selector
    pair_margin: float = 0.0  # a pair needs r_chosen - r_rejected > pair_margin
    schedule: str = ""  # dotted path to `step -> AlgorithmConfig`
    tis_level: str = "token"  # "token" | "sequence"
    kl_target: float = 0.0  # > 0: adaptive KL coefficient towards this KL (kl_in = "reward")
    kl_horizon: int = 10000  # steps of the adaptive KL controller
    kl_cap: float = 0.0  # > 0: clamp per-token KL at this value
    kl_ignore_ref_above: float = 1.0  # < 1: no KL on tokens the reference gives p > this
    value_coef: float = 0.5  # weight of the critic's loss (advantage = "gae")
    value_clip: float = 0.2  # clip range of the critic's prediction around old values
    value_lr: float = 0.0  # learning rate of the critic's value head; 0 = optim.lr
    ref_update_fn: str = ""  # dotted path, for ref_update = "user"
    reward_transform: str = "absolute"  # "absolute" | "relative" (rank) | "pareto" (vector)
    reward_scope: str = "group"  # where relative / pareto compare: "group" | "batch"
    reward_weights: list[float] = dataclasses.field(default_factory=list)  # vector -> weighted sum
    pareto_mode: str = "rank"  # "rank": 1 / (1 + Pareto rank) | "distance": -distance to front
    reward_norm: str = "none"  # "none" | "group" | "batch": (r - mean) / (std + 1e-6)
    overlong_buffer: int = 0  # > 0: DAPO soft overlong penalty over the last N tokens
    overlong_max_length: int = 0  # the response length the penalty reaches -overlong_penalty
    overlong_penalty: float = 1.0
    efficiency_coef: float = 0.0  # > 0: bonus coef * (1 - len / overlong_max_length) if r > 0

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "algorithm.advantage", self.advantage, ADVANTAGES)
        _one_of(p, "algorithm.policy_loss", self.policy_loss, POLICY_LOSSES)
        _one_of(p, "algorithm.loss_agg", self.loss_agg, AGG_MODES)
        _one_of(p, "algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of(p, "algorithm.kl_in", self.kl_in, ("loss", "reward"))
        _one_of(
            p, "algorithm.ref_update", self.ref_update, ("none", "copy", "ema", "periodic", "user")
        )
        _check(
            p,
            self.ref_update != "user" or bool(self.ref_update_fn),
            "algorithm.ref_update_fn: must name a function when algorithm.ref_update = 'user'",
        )
        _one_of(p, "algorithm.tis_level", self.tis_level, ("token", "sequence"))
        _check(p, self.kl_target >= 0.0, "algorithm.kl_target: must be >= 0 (0 = fixed kl_coef)")
        _check(p, self.kl_horizon >= 1, "algorithm.kl_horizon: must be >= 1")
        _check(p, self.kl_cap >= 0.0, "algorithm.kl_cap: must be >= 0 (0 = no cap)")
        _check(p, 0.0 < self.kl_ignore_ref_above <= 1.0, "algorithm.kl_ignore_ref_above: (0, 1]")
        _check(p, self.value_coef >= 0.0, "algorithm.value_coef: must be >= 0")
        _check(p, self.value_clip > 0.0, "algorithm.value_clip: must be > 0")
        _check(p, self.value_lr >= 0.0, "algorithm.value_lr: must be >= 0 (0 = optim.lr)")
        _one_of(
            p,
            "algorithm.reward_transform",
            self.reward_transform,
            ("absolute", "relative", "pareto"),
        )
        _one_of(p, "algorithm.reward_scope", self.reward_scope, ("group", "batch"))
        _one_of(p, "algorithm.pareto_mode", self.pareto_mode, ("rank", "distance"))
        _one_of(p, "algorithm.reward_norm", self.reward_norm, ("none", "group", "batch"))
        _check(p, self.overlong_buffer >= 0, "algorithm.overlong_buffer: must be >= 0")
        _check(p, self.efficiency_coef >= 0.0, "algorithm.efficiency_coef: must be >= 0")
        _check(
            p,
            (self.overlong_buffer == 0 and self.efficiency_coef == 0)
            or self.overlong_max_length >= max(self.overlong_buffer, 1),
            f"algorithm.overlong_max_length = {self.overlong_max_length}: must be >= "
            "overlong_buffer (and >= 1) when the overlong penalty or efficiency bonus is on",
        )
        _check(
            p,
            self.policy_loss != "gspo" or self.loss_agg == "seq-mean-token-mean",
            f"algorithm.loss_agg = {self.loss_agg!r}: GSPO is defined with "
            "'seq-mean-token-mean'; set algorithm.loss_agg = 'seq-mean-token-mean'",
        )
        _check(p, 0.0 <= self.clip_eps_low < 1.0, "algorithm.clip_eps_low: must be in [0, 1)")
        _check(p, self.clip_eps_high >= 0.0, "algorithm.clip_eps_high: must be >= 0")
        _check(
            p,
            self.clip_ratio_c > 1.0,
            f"algorithm.clip_ratio_c = {self.clip_ratio_c}: must be > 1.0 (dual clip)",
        )
        _check(p, self.kl_coef >= 0.0, "algorithm.kl_coef: must be >= 0")
        _check(p, self.tis_cap >= 1.0, f"algorithm.tis_cap = {self.tis_cap}: must be >= 1.0")
        _check(p, 0.0 <= self.ref_ema_decay <= 1.0, "algorithm.ref_ema_decay: in [0, 1]")
        _check(p, self.ref_update_every >= 1, "algorithm.ref_update_every: must be >= 1")
        _check(p, 0.0 <= self.gamma <= 1.0, "algorithm.gamma: must be in [0, 1]")
        _check(p, 0.0 <= self.lam <= 1.0, "algorithm.lam: must be in [0, 1]")
        _check(p, self.ppo_epochs >= 1, "algorithm.ppo_epochs: must be >= 1")
        _check(p, self.mini_batch_size >= 0, "algorithm.mini_batch_size: must be >= 0")
        _check(p, self.pair_beta > 0.0, f"algorithm.pair_beta = {self.pair_beta}: must be > 0")
        _check(p, self.pair_margin >= 0.0, "algorithm.pair_margin: must be >= 0")
        _check(
            p,
            self.pair_selector in PAIR_SELECTORS or "." in self.pair_selector,
            f"algorithm.pair_selector = {self.pair_selector!r}: must be one of {PAIR_SELECTORS} "
            "or a dotted path to a function (group) -> [(chosen, rejected), ...]",
        )
        pairwise = self.policy_loss == "pairwise"
        _check(
            p,
            not pairwise or (self.advantage != "gae" and not self.tis),
            "algorithm.policy_loss = 'pairwise' uses no advantages and no TIS: set "
            "algorithm.advantage to a critic-free estimator (e.g. 'grpo') and tis = false",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig(_Section):
    """[optim]: AdamW and the warmup + cosine schedule."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    scheduler: str = "cosine"  # "cosine" | "constant"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.lr > 0.0, f"optim.lr = {self.lr}: must be > 0")
        _check(p, self.weight_decay >= 0.0, "optim.weight_decay: must be >= 0")
        _check(p, 0.0 <= self.beta1 < 1.0, "optim.beta1: must be in [0, 1)")
        _check(p, 0.0 <= self.beta2 < 1.0, "optim.beta2: must be in [0, 1)")
        _check(p, self.warmup_steps >= 0, "optim.warmup_steps: must be >= 0")
        _one_of(p, "optim.scheduler", self.scheduler, ("cosine", "constant"))
        _check(p, 0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio: must be in [0, 1]")
        _check(p, self.max_grad_norm > 0.0, "optim.max_grad_norm: must be > 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig(_Section):
    """[training]: backend, steps and batching of the trainer."""

    backend: str = "pytorch"  # "pytorch" | "fsdp"
    nproc: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    torch_threads: int = 0  # trainer's torch threads; 0 = a share of the cores (CPU + builtin)
    micro_batch_tokens: int = 4096
    rl_steps: int = 10
    sft_steps: int = 0  # 0 = sft_epochs over the data
    sft_epochs: int = 1
    sft_batch_size: int = 16
    sft_lr: float = 0.0  # 0 = optim.lr
    sync_every: int = 1
    eval_every: int = 0  # 0 = only at the start and the end
    max_consecutive_nonfinite: int = 3
    logprob_chunk_size: int = 1024
    micro_batch_layout: str = "pad"  # "pad" (length-bucketed, right-padded) | "pack" (one row)
    weight_sync_dir: str = ""  # weights-only copies for engines; "" = /dev/shm (else a temp dir)
    weight_sync_attempts: int = 3  # tries per engine before a sync fails

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "training.backend", self.backend, ("pytorch", "fsdp"))
        _one_of(p, "training.device", self.device, ("auto", "cpu", "cuda"))
        _check(p, self.nproc >= 1, f"training.nproc = {self.nproc}: must be >= 1")
        _check(p, self.torch_threads >= 0, "training.torch_threads: must be >= 0 (0 = default)")
        _check(p, self.micro_batch_tokens >= 1, "training.micro_batch_tokens: must be >= 1")
        _check(p, self.rl_steps >= 0, "training.rl_steps: must be >= 0")
        _check(p, self.sft_steps >= 0, "training.sft_steps: must be >= 0")
        _check(p, self.sft_epochs >= 1, "training.sft_epochs: must be >= 1")
        _check(p, self.sft_batch_size >= 1, "training.sft_batch_size: must be >= 1")
        _check(p, self.sync_every >= 1, "training.sync_every: must be >= 1")
        _check(p, self.eval_every >= 0, "training.eval_every: must be >= 0")
        _check(p, self.max_consecutive_nonfinite >= 1, "training.max_consecutive_nonfinite: >= 1")
        _check(p, self.logprob_chunk_size >= 1, "training.logprob_chunk_size: must be >= 1")
        _one_of(p, "training.micro_batch_layout", self.micro_batch_layout, ("pad", "pack"))
        _check(p, self.weight_sync_attempts >= 1, "training.weight_sync_attempts: must be >= 1")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig(_Section):
    """[checkpoint]: where, how often and how many."""

    dir: str = ""  # "" = <run.output_dir>/checkpoints
    every: int = 0  # steps; 0 = only at the end
    keep_last: int = 2
    best_metric: str = "eval/accuracy"  # the step metric that picks the best checkpoint; "" = off
    best_mode: str = "max"  # "max" | "min": which direction of best_metric is better

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.every >= 0, f"checkpoint.every = {self.every}: must be >= 0")
        _check(p, self.keep_last >= 1, f"checkpoint.keep_last = {self.keep_last}: must be >= 1")
        _one_of(p, "checkpoint.best_mode", self.best_mode, ("max", "min"))
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig(_Section):
    """[logging]: console, metrics files, TensorBoard, wandb."""

    console: bool = True
    progress_bar: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rollouts"
    wandb_mode: str = "offline"
    rollouts_per_step: int = 4  # samples written to rollouts.jsonl per step

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "logging.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
        _check(p, self.rollouts_per_step >= 0, "logging.rollouts_per_step: must be >= 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config(_Section):
    """The whole run: one frozen tree, built once in train.py and passed down."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    engines: EnginesConfig = dataclasses.field(default_factory=EnginesConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)


RunConfig = Config  # the name the design uses for the whole tree


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{key} = {value!r}: must be a list of {_type_name(item_tp)}")
            return value
        return [_coerce(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            sub: list[str] = []
            out = _coerce(value, option, key, sub)
            if not sub:
                return out
        problems.append(f"{key} = {value!r}: must be {tp}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        problems.append(f"{key} = {value!r}: must be {_type_name(tp)}, got {type(value).__name__}")
    return value


def _build(cls: type, table: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    """Build section `cls` from `table`, appending every problem found (with key paths)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            valid = ", ".join(sorted(fields))
            problems.append(f"{path}: unknown key{hint}; valid keys here: {valid}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{path}: must be a table [{path}], got {type(value).__name__}")
                continue
            kwargs[key] = _build(tp, value, f"{path}.", problems)
        else:
            before = len(problems)
            coerced = _coerce(value, tp, path, problems)
            if len(problems) == before:  # a badly typed value is reported, not range-checked
                kwargs[key] = coerced
    try:
        return cls(**kwargs)
    except ConfigError as e:
        problems.extend(e.problems)
    except (TypeError, AssertionError) as e:
        problems.append(f"{prefix or 'config'}: {e}")
    return cls()  # a placeholder so that the walk goes on; the error is raised by the caller


def config_from_dict(table: Mapping[str, Any], source: str = "") -> Config:
    """Build and validate a `Config` from a plain dict (parsed TOML)."""
    problems: list[str] = []
    config = _build(Config, table, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return config


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError([f"--set {text!r}: must look like section.key=value"])
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string: --set run.name=demo
    return key.strip().split("."), value


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides (values parsed as TOML, else taken as strings)."""
    for text in overrides:
        path, value = _parse_override(text)
        node = table
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {text!r}: {part} is not a table"])
        node[path[-1]] = value
    return table


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML file into a validated `Config`; `overrides` are `key.path=value` strings."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such config file"])
    try:
        table = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: invalid TOML: {e}"], str(path)) from e
    table = apply_overrides(table, overrides or [])
    return config_from_dict(table, str(path))


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as a plain dict (for writing the resolved config of a run)."""
    return dataclasses.asdict(config)
