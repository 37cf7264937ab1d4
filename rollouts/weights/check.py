"""The content check of a weight sync: an engine must serve the trainer's weights, not only
report the trainer's version label.

After the trainer's update, `trainer_probe` computes the trainer's logprobs of a fixed probe
sequence (teacher-forced, in order after the update on the training thread). After an engine
loads the weights, `check_engine` asks it for its prompt logprobs of the same tokens
(`InferenceEngine.prompt_logprobs`) and compares: a gap over the tolerance (set by the dtype)
is a `WeightContentError` naming the engine, the version, the gap and where it is. The sync
treats it like a failed load: retried, then the engine is marked down.

A label proves nothing: vLLM reloading a tied embedding without `lm_head.weight` kept the old
LM head while reporting the new version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from rollouts.config import Config
from rollouts.config.auto import engine_numerics, training_device_type
from rollouts.engine_kinds import engine_kind
from rollouts.types import FULL_PRECISION, TrainBatch

# The |engine - trainer| logprob gap on the probe that still counts as the same weights, and
# which gap: the largest one in fp32, the mean over the probe in half precision.
# fp32 engine vs fp32 trainer: largest ~1e-5 (vLLM's CPU build and the built-in engine); a stale
# LM head after one RL step: >= 1e-3. A bf16 engine rounds its logits (spacing 0.125 at 16-32):
# against the fp32 trainer, SmolLM2's 32-token probes of 12 seeds had largest gaps of 0.15-0.51
# but mean gaps of 0.050-0.099 (the largest is noise; the mean is what moves for other weights).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.2, "float16": 0.1}
GAP_STATISTIC = {"float32": "largest", "bfloat16": "mean", "float16": "mean"}


class WeightContentError(RuntimeError):
    """An engine serves other weights than the trainer's (the message says how far off)."""


class ServesPromptLogprobs(Protocol):
    """What the check needs of an engine."""

    url: str

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> tuple[float, ...]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightProbe:
    """A probe sequence and the trainer's logprob of each of its tokens after the first."""

    ids: tuple[int, ...]
    expected: tuple[float, ...]  # expected[t] = logprob of ids[t + 1] given ids[: t + 1]
    tolerance: float
    version: str
    statistic: str = "largest"  # which gap is held to the tolerance: "largest" or "mean"
    trainer_s: float = 0.0  # the trainer's forward for `expected` (part of the check's cost)

    def __post_init__(self) -> None:
        assert len(self.ids) >= 2, f"{len(self.ids)=}: a probe needs two tokens"
        assert len(self.expected) == len(self.ids) - 1, f"{len(self.expected)=} {len(self.ids)=}"
        assert self.tolerance > 0, f"{self.tolerance=}"
        assert self.statistic in ("largest", "mean"), f"{self.statistic=}"


def probe_ids(vocab_size: int, length: int, seed: int) -> tuple[int, ...]:
    """A fixed probe: `length` token ids drawn from [0, vocab_size) by `seed`."""
    assert vocab_size >= 2, f"{vocab_size=}"
    assert length >= 2, f"{length=}"
    rng = np.random.default_rng([seed, 0x5EED])
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=length))


def tolerance_for(dtype: str, configured: float) -> float:
    """`configured` when set (> 0), else the default for the model's dtype."""
    if configured > 0:
        return configured
    assert dtype in TOLERANCE, f"{dtype=} not in {sorted(TOLERANCE)}"
    return TOLERANCE[dtype]


def _gaps(expected: Sequence[float], served: Sequence[float]) -> np.ndarray | None:
    """|expected - served| per position; None when the lengths differ."""
    if len(expected) != len(served):
        return None
    return np.abs(np.asarray(expected, dtype=np.float64) - np.asarray(served, dtype=np.float64))


def largest_gap(expected: Sequence[float], served: Sequence[float]) -> tuple[float, int]:
    """(max |expected - served|, its position); inf when the lengths differ or a value is NaN."""
    gaps = _gaps(expected, served)
    if gaps is None:
        return float("inf"), -1
    if not len(gaps):
        return 0.0, -1
    if np.isnan(gaps).any():
        return float("inf"), int(np.argmax(np.isnan(gaps)))
    at = int(np.argmax(gaps))
    return float(gaps[at]), at


def mean_gap(expected: Sequence[float], served: Sequence[float]) -> float:
    """The mean |expected - served|; inf when the lengths differ or a value is NaN."""
    gaps = _gaps(expected, served)
    if gaps is None or np.isnan(gaps).any():
        return float("inf")
    return float(gaps.mean()) if len(gaps) else 0.0


async def trainer_probe(
    backend: Any, ids: Sequence[int], version: str, tol: float, statistic: str = "largest"
) -> WeightProbe:
    """The trainer's logprobs of `ids` now (queued after the work submitted before it)."""
    started = time.perf_counter()
    ids_T = torch.tensor(list(ids), dtype=torch.long)
    mask_T = torch.ones(len(ids), dtype=torch.float32)
    mask_T[0] = 0.0  # the first token is only context
    batch = TrainBatch(
        input_ids=(ids_T,),
        loss_mask=(mask_T,),
        num_global_tokens=float(len(ids) - 1),
        num_global_seqs=1.0,
        max_response_length=len(ids),
        metadata={FULL_PRECISION: True},  # the weights themselves: no autocast
    )
    (logprobs_T,) = await backend.compute_logprobs(batch)
    expected = tuple(float(x) for x in logprobs_T[1:].tolist())
    took = time.perf_counter() - started
    return WeightProbe(
        ids=tuple(ids),
        expected=expected,
        tolerance=tol,
        version=version,
        statistic=statistic,
        trainer_s=took,
    )


async def check_engine(
    engine: ServesPromptLogprobs, probe: WeightProbe, step: int | None = None
) -> float:
    """The engine's logprob gap to the trainer on the probe (the probe's statistic: largest or
    mean); raises WeightContentError when it is over the tolerance."""
    served = await engine.prompt_logprobs(probe.ids)
    largest, at = largest_gap(probe.expected, served)
    gap = largest if probe.statistic == "largest" else mean_gap(probe.expected, served)
    if gap <= probe.tolerance:
        return gap
    at_step = f" at step {step}" if step is not None else ""
    if len(served) != len(probe.expected):
        where = f"({len(served)} values returned for {len(probe.expected)})"
    elif probe.statistic == "largest":
        where = f"at probe position {at + 1}"
    else:
        where = f"on average over the probe (largest {largest:.3g} at position {at + 1})"
    raise WeightContentError(
        f"{engine.url} reports weight version {probe.version!r}{at_step} but does not serve the "
        f"trainer's weights: its logprobs of the probe differ by {gap:.3g} {where} (tolerance "
        f"{probe.tolerance:.3g}, weight_sync.check_tolerance). A reload that missed tensors (a "
        "tied LM head), an engine serving another model or dtype, or a failed load gives this."
    )


def probe_metrics(probe: WeightProbe | None) -> dict[str, float]:
    """The trainer's side of the check's cost, for the sync's metrics."""
    return {} if probe is None else {"probe_s": probe.trainer_s}


def probe_dtype(config: Config) -> str:
    """The coarser precision of the two sides: the trainer's probe (computed without autocast:
    the model's dtype; bf16 on CUDA, where engines serve bf16) and, for built-in engines, the
    dtype they serve in (their autocast dtype where they run under one)."""
    on_cuda = training_device_type(config.training) == "cuda"  # "auto" read as torch sees it
    trainer = "bfloat16" if on_cuda else config.model.dtype
    if not engine_kind(config.engines.kind).started_here:
        return trainer
    b = config.engines.builtin
    served = engine_numerics(config, b)  # autocast: bf16 matmuls
    return max(trainer, served, key=TOLERANCE.__getitem__)


def content_probe(
    config: Config, backend: Any, tokenizer: Any
) -> Callable[[str], Awaitable[WeightProbe]] | None:
    """`version -> the trainer's probe now`, or None when `weight_sync.check` is off."""
    ws = config.weight_sync
    if not ws.check:
        return None
    ids = probe_ids(len(tokenizer), ws.check_tokens, config.run.seed)
    dtype = probe_dtype(config)
    tol = tolerance_for(dtype, ws.check_tolerance)

    async def probe(version: str) -> WeightProbe:
        return await trainer_probe(backend, ids, version, tol, GAP_STATISTIC[dtype])

    return probe


async def check_engines_at_start(
    engines: Sequence[ServesPromptLogprobs],
    probe: WeightProbe,
    *,
    who: str = "engines",
    serves: str = "the trainer's weights",
    fix: str = "Start the engines on the run's model (model.path) in the same dtype, or set "
    "weight_sync.check_tolerance.",
) -> None:
    """Every engine must serve the starting weights before any step (an engine started on
    another model or dtype fails here, not as a silent off-policy run). `who`, `serves` and
    `fix` word the lines and the error (a teacher's or a judge's engines: `driver/served.py`)."""
    errors: list[str] = []
    for engine in engines:
        try:
            gap = await check_engine(engine, probe)
        except WeightContentError as exc:
            errors.append(str(exc))
            continue
        print(f"[{who}] {engine.url} serves {serves} (gap {gap:.2g})", flush=True)
    if errors:
        raise WeightContentError("at start: " + "\n".join(errors) + f"\n{fix}")
