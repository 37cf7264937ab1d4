"""The "auto" speed keys, each resolved by a measured rule (docs/benchmarks.md, "Fast by default").

A key set explicitly always wins; these rules only decide "auto" (and micro_batch_tokens = 0):
- `training.autocast`: bf16 autocast (fp32 master weights and optimizer) on CUDA, and on a CPU
  with bf16 matmul units (AVX-512 BF16 or AMX: /proc/cpuinfo's avx512_bf16 / amx_bf16 flags)
  when the run starts its own engines. Elsewhere fp32: a CPU without them emulates bf16, slower
  than fp32, and servers at URLs on CPU compute in their own dtype (usually fp32).
- `engines.builtin.dtype` and `autocast` (the run's own engines, teachers' and judges' too):
  bf16 weights where the trainer autocasts to bf16 (a bf16 engine: the demo's model decoded at
  1.13-1.27x fp32 weights under autocast, SmolLM2 at 1.02x), else the trainer's model.dtype.
  With fp32 weights set by hand, "auto" autocast computes as the trainer (bf16 matmuls where it
  autocasts). A standalone `rollouts serve` has no trainer to follow: "auto" is fp32, no
  autocast.
- `model.attn_implementation` (the trainer's, and the run's engines' prefill): "eager" on CPU,
  where it trains faster than "sdpa" at these lengths; "sdpa" on CUDA.
- `training.micro_batch_layout`: "prefix" (a group's prompt computed once: 1.41-1.58x a step on
  CPU) where it can run (one device, full attention, no gradient checkpointing), on CPU, when
  prompts come in groups; else "pad" (CUDA too: not measured there).
- `training.micro_batch_tokens` = 0: on CPU 2^20 / the model's hidden size, a power of two
  (the demo's model, hidden 128: 8192, whose RL steps ran 1.17x faster than at 2048 in a run;
  SmolLM2, hidden 576: 2048, 1.11x against 4096); 4096 on CUDA.
No torch here: the callers pass the device type they resolved.

`emulated_bf16` names the keys that put bf16 on a CPU without bf16 units: an explicit setting
wins, but a run says that its matmuls are emulated there (a demo RL step 4.40 s against 0.38 s
in fp32 on a Zen 3 EPYC, whose bf16 matmul ran at 10 GFLOP/s a core against fp32's 85).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollouts.config import Config
    from rollouts.config.engine_options import EngineOptions
    from rollouts.config.training import TrainingConfig

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
MICRO_BATCH_TOKENS = {"cuda": 4096}
ACTIVATIONS = 1 << 20  # a CPU micro-batch's tokens x hidden size


CPU_BF16_ENV = "ROLLOUTS_CPU_BF16"  # "0" / "1": overrides what /proc/cpuinfo says


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matmul units (AVX-512 BF16 or AMX); False where unknown.
    ROLLOUTS_CPU_BF16=0 (or 1) overrides the flags: fp32 defaults on any CPU (the test suite's
    exactness checks run so), or bf16 where a container hides the flags."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{CPU_BF16_ENV}={forced!r}: set it to 0 or 1, or unset it")
    return cpu_flags_bf16("/proc/cpuinfo")


@functools.cache
def cpu_flags_bf16(cpuinfo: str) -> bool:
    """Whether the `flags` line of `cpuinfo` names avx512_bf16 or amx_bf16."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(set(line.split(":", 1)[-1].split()) & set(BF16_CPU_FLAGS))
    return False


def autocasts(setting: str, device_type: str, engines_follow: bool = True) -> bool:
    """Whether a trainer with `training.autocast = setting` runs under bf16 autocast.
    `engines_follow`: the run starts its engines (they then compute as the trainer does). On a
    CPU, "auto" is bf16 only then: servers at URLs compute in their own dtype (on CPU builds
    usually fp32), which a bf16 trainer would miss by bf16's rounding."""
    if setting == "auto":
        cpu_bf16 = device_type == "cpu" and engines_follow and cpu_has_bf16()
        return device_type == "cuda" or cpu_bf16
    return setting == "bfloat16"


def trainer_autocasts(config: Config, device_type: str) -> bool:
    """Whether the run's trainer (on `device_type`) runs under bf16 autocast."""
    from rollouts.engine_kinds import engine_kind

    follow = engine_kind(config.engines.kind).started_here
    return autocasts(config.training.autocast, device_type, follow)


def training_device_type(training: TrainingConfig) -> str:
    """ "cpu" or "cuda": `training.device`, "auto" read as cuda where torch sees a GPU."""
    if training.device != "auto":
        return training.device.split(":")[0]
    import torch  # only for "auto", outside the torch-free config paths

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_dtype(config: Config, builtin: EngineOptions) -> str:
    """The weights' dtype of a built-in engine the run starts: its `dtype` as set, or for
    "auto" bf16 where the trainer autocasts to it (and no autocast is asked of the engine,
    which needs fp32 weights), else the trainer's `model.dtype`."""
    if builtin.dtype != "auto":
        return builtin.dtype
    if builtin.autocast not in ("auto", "off"):
        return "float32"
    trainer_bf16 = trainer_autocasts(config, training_device_type(config.training))
    return "bfloat16" if trainer_bf16 else config.model.dtype


def engine_autocast(config: Config, builtin: EngineOptions) -> str:
    """What a built-in engine the run starts computes under: its `autocast` as set, or for
    "auto" the trainer's where the engine holds fp32 weights (bf16 where `training.autocast`
    resolves to it), else "off" (16-bit weights compute in their dtype)."""
    if builtin.autocast != "auto":
        return builtin.autocast
    if engine_dtype(config, builtin) != "float32":
        return "off"
    trainer_bf16 = trainer_autocasts(config, training_device_type(config.training))
    return "bfloat16" if trainer_bf16 else "off"


def engine_numerics(config: Config, builtin: EngineOptions) -> str:
    """The dtype a run's built-in engine computes in: its autocast's, else its weights'."""
    autocast = engine_autocast(config, builtin)
    return engine_dtype(config, builtin) if autocast == "off" else autocast


def attention(setting: str, device_type: str) -> str:
    """`model.attn_implementation` for a model on `device_type`."""
    if setting != "auto":
        return setting
    return "sdpa" if device_type == "cuda" else "eager"


def micro_batch_layout(config: Config) -> str:
    """`training.micro_batch_layout`; "auto" -> "prefix" on CPU where it can run and prompts
    come in groups, else "pad" (a model it cannot train is found when it loads: the backend's
    factory then falls back to "pad")."""
    t = config.training
    if t.micro_batch_layout != "auto":
        return t.micro_batch_layout
    one_device = t.backend == "pytorch" and t.nproc == 1 and t.nnodes == 1
    grouped = config.rollout.n_samples_per_prompt > 1
    on_cpu = training_device_type(t) == "cpu"  # measured there; CUDA keeps "pad" until it is
    ok = one_device and grouped and on_cpu and not config.model.gradient_checkpointing
    return "prefix" if ok else "pad"


def micro_batch_tokens(setting: int, device_type: str, hidden_size: int = 0) -> int:
    """`training.micro_batch_tokens`; 0 -> on CPU about a million activations a layer (2^20 /
    the hidden size, a power of two in 1024..16384: 8192 for the demo's 128, 2048 for SmolLM2's
    576; 4096 where the size is unknown); on CUDA 4096."""
    if setting:
        return setting
    if device_type == "cuda" or hidden_size <= 0:
        return MICRO_BATCH_TOKENS["cuda"]
    return min(max(1 << round(math.log2(ACTIVATIONS / hidden_size)), 1024), 16384)


def chosen(config: Config) -> str:
    """One line naming what each key left at "auto" (or 0) resolves to here, "" when none is."""
    t, device = config.training, training_device_type(config.training)
    out = []
    if t.autocast == "auto":
        why = "CUDA" if device == "cuda" else f"CPU bf16 units: {cpu_has_bf16()}"
        out.append(
            f"training.autocast = {'bfloat16' if autocasts('auto', device) else 'off'} ({why})"
        )
    if config.model.attn_implementation == "auto":
        out.append(f"model.attn_implementation = {attention('auto', device)}")
    if t.micro_batch_tokens == 0:
        hidden = config.model.tiny.hidden_size if config.model.tiny.enabled else 0
        size = micro_batch_tokens(0, device, hidden) if hidden or device == "cuda" else 0
        out.append(f"training.micro_batch_tokens = {size or '2^20 / the hidden size'}")
    if t.micro_batch_layout == "auto":
        out.append(f"training.micro_batch_layout = {micro_batch_layout(config)}")
    from rollouts.engine_kinds import engine_kind

    b = config.engines.builtin
    if engine_kind(config.engines.kind).started_here:
        if b.dtype == "auto":
            out.append(f"engines.builtin.dtype = {engine_dtype(config, b)}")
        if b.autocast == "auto":
            out.append(f"engines.builtin.autocast = {engine_autocast(config, b)}")
    return "; ".join(out)


def emulated_bf16(config: Config) -> str:
    """The keys that make this run compute in bf16 on a CPU without bf16 matmul units, and the
    fix ("" where none does, or the CPU has the units)."""
    if cpu_has_bf16():
        return ""
    from rollouts.engine_kinds import engine_kind

    keys = []
    t = config.training
    if training_device_type(t) == "cpu":
        if config.model.dtype == "bfloat16":
            keys.append('model.dtype = "bfloat16"')
        for name, value in (("autocast", t.autocast), ("sft_autocast", t.sft_autocast)):
            if value == "bfloat16":
                keys.append(f'training.{name} = "bfloat16"')
    sections = [("engines", config.engines)]
    served = [s for s in (config.teacher, config.judge) if s.enabled]
    sections += [(f"{s.KEY}.engines", s.engines) for s in served]
    for name, engines in sections:
        b = engines.builtin
        if not engine_kind(engines.kind).started_here or b.device != "cpu":
            continue
        if engine_numerics(dataclasses.replace(config, engines=engines), b) != "bfloat16":
            continue
        explicit = [k for k in ("autocast", "dtype") if getattr(b, k) == "bfloat16"]
        if explicit:
            keys.append(f'{name}.builtin.{explicit[0]} = "bfloat16"')
        else:  # "auto": the trainer's bf16 autocast, named above
            keys.append(f"{name}.builtin (auto: as training.autocast)")
    if not keys:
        return ""
    return (
        f"this CPU has no bf16 matmul units (neither {' nor '.join(BF16_CPU_FLAGS)} in "
        f"/proc/cpuinfo), so bf16 is emulated here, several times slower than float32: "
        f'{", ".join(keys)}. Set them to "auto" (float32 here, bf16 where the CPU has the '
        f"units), or {CPU_BF16_ENV}=1 where a container hides the flags"
    )
