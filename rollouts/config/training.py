"""[optim], [training], [checkpoint] and [logging] sections."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

Scheduler = Literal["cosine", "constant"]
TrainingBackendName = Literal["pytorch", "fsdp"]
TrainingDevice = Literal["auto", "cpu", "cuda"]
# length-bucketed, right-padded | one packed row | shared prompts run once (trainer/prefix_plan.py)
MicroBatchLayout = Literal["auto", "pad", "pack", "prefix"]
LogprobPositions = Literal["trained", "all"]
CpuPlacement = Literal["auto", "colocate", "split", "off"]
TrainerProcessMode = Literal["auto", "on", "off"]
Autocast = Literal["auto", "bfloat16", "off"]
SftAutocast = Literal["", "auto", "bfloat16", "off"]  # "" = training.autocast
BestMode = Literal["max", "min"]
OnCorrupt = Literal["stop", "fall_back"]  # a resume whose checkpoint fails verification
WandbMode = Literal["offline", "online", "disabled"]
RunMode = Literal["sft", "rl", "sft+rl"]  # train.py --mode: the phases a run runs
# the RL phase's halves: both (generate, then train), --rollout-only (generate and store the
# batches, no trainer) or --replay RUN (train on RUN's stored batches, no engines)
RLHalves = Literal["both", "rollout-only", "replay"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig(_Section):
    """[optim]: AdamW and the warmup + cosine schedule."""

    KEY: ClassVar[str] = "optim"

    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    scheduler: Scheduler = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.lr > 0.0, f"optim.lr = {self.lr}: must be > 0")
        _check(p, self.weight_decay >= 0.0, "optim.weight_decay: must be >= 0")
        _check(p, 0.0 <= self.beta1 < 1.0, "optim.beta1: must be in [0, 1)")
        _check(p, 0.0 <= self.beta2 < 1.0, "optim.beta2: must be in [0, 1)")
        _check(p, self.warmup_steps >= 0, "optim.warmup_steps: must be >= 0")
        _check(p, 0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio: must be in [0, 1]")
        _check(p, self.max_grad_norm > 0.0, "optim.max_grad_norm: must be > 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig(_Section):
    """[training]: backend, steps and batching of the trainer."""

    KEY: ClassVar[str] = "training"

    backend: TrainingBackendName = "pytorch"
    nproc: int = 1  # trainer processes per node (FSDP under torchrun when the total is > 1)
    # several nodes: train.py runs `torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint
    # HOST:PORT` (the same command on every node; docs/scaling.md)
    nnodes: int = 1
    rdzv_endpoint: str = ""  # HOST:PORT of the rendezvous, reachable from every node
    device: TrainingDevice = "auto"
    torch_threads: int = 0  # trainer's torch threads; 0 = a share of the cores (CPU + builtin)
    micro_batch_tokens: int = 0  # 0 = auto: 2048 on CPU, 4096 on CUDA (config/auto.py)
    rl_steps: int = 10
    sft_steps: int = 0  # 0 = sft_epochs over the data
    sft_epochs: int = 1
    sft_batch_size: int = 16
    sft_lr: float = 0.0  # 0 = optim.lr
    eval_every: int = 0  # 0 = only at the start and the end
    max_consecutive_nonfinite: int = 3
    # tokens per LM-head chunk (recomputed in backward when several); 0 = auto: 512 MiB of
    # float32 logits per chunk (one chunk for small vocabularies)
    logprob_chunk_size: int = 0
    # "pad": right-padded rows of similar length; "pack": one row of sequences end to end;
    # "prefix": sequences that begin alike (a GRPO group's prompt) run those tokens once, the
    # rest padded (one device only: training.backend = "pytorch", nproc = nnodes = 1);
    # "auto": "prefix" where it can run and prompts come in groups, else "pad"
    micro_batch_layout: MicroBatchLayout = "auto"
    # "trained": the LM head (logprobs, entropy) runs only on tokens with loss_mask = 1, the
    # others read 0 (prompts cost no head: verl and TRL do the same); "all": every position,
    # for a custom loss that reads the logprobs of untrained tokens
    logprob_positions: LogprobPositions = "trained"
    # on CPU with built-in engines (driver/placement.py): "auto" = "colocate" in sync mode,
    # "split" in async mode; "colocate": the trainer (SFT too) and the engines each get every
    # core (the phases alternate; OpenMP waits are passive); "split": the training thread, each
    # engine and (async) the driver on cores of their own; "off": leave it to the OS
    cpu_placement: CpuPlacement = "auto"
    # "auto": train in a child process when async mode runs with that CPU placement (the
    # driver's Python then never holds the training thread's GIL; trainer/process.py);
    # "on": always (one-device backend); "off": train in the driver's process
    trainer_process: TrainerProcessMode = "auto"
    # forward and backward under torch.autocast, fp32 master weights and optimizer: "auto" =
    # bfloat16 on CUDA, and on a CPU with bf16 units (AVX-512 BF16 / AMX) when the run starts
    # its engines, else off (config/auto.py); "bfloat16" everywhere (the content check then
    # allows bf16's tolerance; slow on a CPU that emulates bf16); "off": fp32 everywhere
    autocast: Autocast = "auto"
    # the SFT phase's autocast: "" = `autocast`; else one of its values for SFT alone
    sft_autocast: SftAutocast = ""

    def for_sft(self) -> TrainingConfig:
        """This section as the SFT phase trains with it (`sft_autocast` in place of `autocast`)."""
        if not self.sft_autocast:
            return self
        return dataclasses.replace(self, autocast=self.sft_autocast, sft_autocast="")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.nproc >= 1, f"training.nproc = {self.nproc}: must be >= 1")
        _check(p, self.nnodes >= 1, f"training.nnodes = {self.nnodes}: must be >= 1")
        _check(
            p,
            self.nnodes == 1 or _host_port(self.rdzv_endpoint),
            f"training.rdzv_endpoint = {self.rdzv_endpoint!r}: training.nnodes = {self.nnodes} "
            "needs HOST:PORT, an address of the first node every node reaches (e.g. "
            "node001:29500)",
        )
        _check(p, self.torch_threads >= 0, "training.torch_threads: must be >= 0 (0 = default)")
        _check(
            p,
            self.micro_batch_tokens >= 0,
            "training.micro_batch_tokens: must be >= 1, or 0 (auto: 2048 on CPU, 4096 on CUDA)",
        )
        _check(p, self.rl_steps >= 0, "training.rl_steps: must be >= 0")
        _check(p, self.sft_steps >= 0, "training.sft_steps: must be >= 0")
        _check(p, self.sft_epochs >= 1, "training.sft_epochs: must be >= 1")
        _check(p, self.sft_batch_size >= 1, "training.sft_batch_size: must be >= 1")
        _check(p, self.eval_every >= 0, "training.eval_every: must be >= 0")
        _check(p, self.max_consecutive_nonfinite >= 1, "training.max_consecutive_nonfinite: >= 1")
        _check(
            p,
            self.logprob_chunk_size >= 0,
            "training.logprob_chunk_size: must be >= 1 (tokens per chunk), or 0 (auto)",
        )
        _check(
            p,
            self.micro_batch_layout != "prefix"
            or (self.backend == "pytorch" and self.nproc == 1 and self.nnodes == 1),
            "training.micro_batch_layout = 'prefix' runs on one device (training.backend = "
            "'pytorch', nproc = nnodes = 1); with FSDP set it to 'pad'",
        )
        _check(
            p,
            self.trainer_process != "on" or self.backend == "pytorch",
            "training.trainer_process = 'on' needs training.backend = 'pytorch' (FSDP ranks are "
            "their own processes already): set it to 'auto' or 'off'",
        )
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig(_Section):
    """[checkpoint]: where, how often and how many."""

    KEY: ClassVar[str] = "checkpoint"

    dir: str = ""  # "" = <run.output_dir>/checkpoints
    every: int = 0  # steps; 0 = only at the end
    keep_last: int = 2
    best_metric: str = "eval/accuracy"  # the step metric that picks the best checkpoint; "" = off
    best_mode: BestMode = "max"  # which direction of best_metric is better
    # --resume and the newest checkpoint fails verification (a file missing, of another size or
    # checksum): "stop" (name it, list the intact ones) or "fall_back" to the newest intact one
    on_corrupt: OnCorrupt = "stop"

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.every >= 0, f"checkpoint.every = {self.every}: must be >= 0")
        _check(p, self.keep_last >= 1, f"checkpoint.keep_last = {self.keep_last}: must be >= 1")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig(_Section):
    """[logging]: console, metrics files, TensorBoard, wandb."""

    KEY: ClassVar[str] = "logging"

    console: bool = True
    progress_bar: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rollouts"
    wandb_mode: WandbMode = "offline"
    rollouts_per_step: int = 4  # samples written to rollouts.jsonl per step
    # the PNGs in RUN/plots at the end of the run (about a second of CPU: matplotlib's import and
    # seven figures); `rollouts plot RUN` writes them later from metrics.jsonl
    plots: bool = True
    # RUN/trace.json: a timeline of the run (driver, engines, trainer, weight syncs, rewards, each
    # sample's life) in the Chrome trace format, for ui.perfetto.dev (`rollouts/tracing.py`)
    trace: bool = False
    # each RL step's batch as trained in RUN/batches/step_NNNNNN/ (token ids, masks, rewards,
    # the engine's logprobs, advantages...): `--replay RUN` trains on them with no engines
    save_batches: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.rollouts_per_step >= 0, "logging.rollouts_per_step: must be >= 0")
        return p


def _host_port(endpoint: str) -> bool:
    """Whether `endpoint` reads HOST:PORT with a port in [1, 65535]."""
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
