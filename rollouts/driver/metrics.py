"""Metrics sinks: metrics.jsonl (one line per step), the console, TensorBoard and wandb.

`metrics.jsonl` is the source of truth (plots read it). On resume from step k it is cut back to
the lines with step <= k, so a run killed after logging step k+2 but checkpointing step k has no
duplicate and no missing step once it continues (a run killed after checkpointing step k but
before logging it gets the line back from the checkpoint: `last_step` tells the driver).
Lines are written whole: a write that fails (a full disk) is cut back to the last whole line, and
a torn last line left by an older writer or a crash is cut on resume.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from rollouts.algorithms.advantages import reverse_kl_per_token
from rollouts.config import WandbMode
from rollouts.data.loaders import SOURCE_KEY
from rollouts.driver.jsonl import read_rows
from rollouts.failures import failure_reason
from rollouts.rewards.shaping import scored_reward
from rollouts.rollout.sample_runs import TIMING_KEY
from rollouts.trainer.disk_errors import write_error
from rollouts.types import Sample, Status, sample_to_dict


class MetricsSink(Protocol):
    """Receives one dict of scalar metrics per step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _as_json(reward: Any) -> Any:
    """A reward as JSON writes it (a vector as a list)."""
    return list(reward) if isinstance(reward, tuple) else reward


def read_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a step-keyed JSONL file; a torn last line (a crash mid-write) is left out.

    A line that does not parse anywhere else is an error naming the file and the line.
    """
    return read_rows(path)[0]


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep only the whole lines of a step-keyed JSONL file with step <= max_step; return lines
    kept. A torn last line is dropped."""
    if not path.exists():
        return 0
    kept = [row for row in read_jsonl_rows(path) if row.get("step", -1) <= max_step]
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    except OSError as e:  # a full disk on resume: the path, not a bare [Errno 28]
        tmp.unlink(missing_ok=True)
        raise write_error(f"{path.name} (cut back to step {max_step}) as", tmp, e) from e
    tmp.replace(path)
    return len(kept)


def last_step(path: Path) -> int | None:
    """The largest step logged in a JSONL file (None: no file or no line)."""
    if not path.exists():
        return None
    return max((int(row.get("step", -1)) for row in read_jsonl_rows(path)), default=None)


def append_line(file: Any, path: Path, line: str, what: str = "metrics") -> None:
    """Append one whole line to `file` (binary, unbuffered) or none of it: on a write error
    (a full disk) the file is cut back to where it was and a DiskWriteError names `path`."""
    data = line.encode("utf-8")
    start = file.seek(0, 2)
    try:
        view = memoryview(data)
        while view:
            view = view[file.write(view) :]
    except OSError as e:
        file.truncate(start)
        raise write_error(what, path, e) from e


class JsonlSink:
    """Appends `{"step": k, ...metrics}` lines to a file, each written whole."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_jsonl(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("ab", buffering=0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        append_line(self._file, self.path, json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


# what rollouts.jsonl keeps of an episode's metadata (multi-turn loop, gateway)
EPISODE_KEYS = (
    "messages",
    "calls",
    "tool_calls",
    "turns",
    "stop_reason",
    "episode_end",
    "response_text",
)
CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "acc", "{:.3f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("sft/loss", "loss", "{:.4f}"),
    ("sft/eval_loss", "eval_loss", "{:.4f}"),
    ("sft/eval_accuracy", "eval_acc", "{:.3f}"),
    ("train/kl", "kl", "{:.4f}"),
    ("train/entropy", "ent", "{:.3f}"),
    ("train/grad_norm", "gnorm", "{:.2f}"),
    ("groups/all_equal_frac", "flat", "{:.2f}"),  # groups whose rewards are all equal
    ("rollout/response_length_mean", "len", "{:.1f}"),
    ("perf/step_time_s", "s/step", "{:.2f}"),
)


def format_eta(seconds: float) -> str:
    """`1h02m`, `3m05s` or `42s`."""
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(step: int, total: int, eta_s: float, metrics: Mapping[str, float]) -> str:
    """One compact console line: a progress bar, the ETA and the main metrics."""
    frac = min(step / total, 1.0) if total else 1.0
    width = 20
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    parts = [f"[{bar}] {step}/{total} eta {format_eta(eta_s)}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics and isinstance(metrics[key], (int, float)):
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


class ConsoleSink:
    """Prints one line per step with a progress bar and ETA."""

    def __init__(self, total_steps: int, prefix: str = "", stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.prefix = prefix
        self.stream = stream or sys.stdout
        self._start = time.monotonic()
        self._first_step: int | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._first_step is None:
            self._first_step = step - 1
        done = step - self._first_step
        remaining_total = self.total_steps - self._first_step
        elapsed = time.monotonic() - self._start
        eta = elapsed / done * max(remaining_total - done, 0) if done > 0 else 0.0
        line = progress_line(step, self.total_steps, eta, metrics)
        print(f"{self.prefix}{line}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars to TensorBoard (needs the `tensorboard` extra)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                "logging.tensorboard = true needs TensorBoard: pip install tensorboard"
            ) from e
        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars to Weights & Biases (the `wandb` extra); mode "offline" needs no network."""

    def __init__(
        self, project: str, name: str, run_dir: str | Path, mode: WandbMode, config: dict
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("logging.wandb = true needs wandb: pip install wandb") from e
        self._run = wandb.init(
            project=project, name=name, dir=str(run_dir), mode=mode, config=config
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans one step's metrics out to every sink; also writes sampled rollouts per step
    (rollouts.jsonl) and every held-out evaluation's episodes (eval_rollouts.jsonl).

    `probes` add their own metrics to every step (`step -> {name: value}`, e.g. the processes'
    memory: `rollouts.driver.memory.MemoryWatch`)."""

    def __init__(
        self,
        sinks: Sequence[MetricsSink],
        rollouts_path: Path | None = None,
        probes: Sequence[Callable[[int], Mapping[str, float]]] = (),
        eval_path: Path | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.rollouts_path = rollouts_path
        self.eval_path = eval_path
        self.probes = list(probes)
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for probe in self.probes:
            metrics = {**metrics, **probe(step)}
        self.history.append({"step": step, **metrics})
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_samples(
        self, step: int, samples: Sequence[Sample], decode: Any, *, held_out: bool = False
    ) -> None:
        """Append (prompt, response text and tokens, scored reward, status; its times: waiting
        for a slot, generating, scoring; an episode's messages and counts; the reverse KL to the
        teacher when distilling) of `samples` to rollouts.jsonl (`held_out`:
        eval_rollouts.jsonl); a FAILED sample's row also has its `error` (in full) and
        `failure` (its reason)."""
        path = self.eval_path if held_out else self.rollouts_path
        if path is None or not samples:
            return
        lines = []
        for s in samples:
            row = sample_to_dict(s)
            out = {
                "step": step,
                "index": s.index,
                "group_index": s.group_index,
                "prompt": row["prompt"],
                "response": decode(list(s.response_tokens)),
                "reward": _as_json(scored_reward(s)),
                "label": row["label"],
                "status": row["status"],
                "weight_versions": row["weight_versions"],
                "response_tokens": s.response_length,
            }
            if TIMING_KEY in s.metadata:  # {"queue_s", "generate_s", "reward_s"}: seconds
                out["timing"] = dict(s.metadata[TIMING_KEY])
            if SOURCE_KEY in s.metadata:  # a mixture's: the source the prompt came from
                out["source"] = s.metadata[SOURCE_KEY]
            if s.status is Status.FAILED:
                out["error"] = str(s.metadata.get("error", ""))
                out["failure"] = failure_reason(s)
            if s.teacher_logprobs:  # distillation: the sample's per-token reverse KL
                out["reverse_kl"], _ = reverse_kl_per_token([[s]])
            # an episode's conversation and counts (the multi-turn loop's, the gateway's)
            out |= {k: s.metadata[k] for k in EPISODE_KEYS if k in s.metadata}
            lines.append(json.dumps(out, default=str) + "\n")
        with path.open("ab", buffering=0) as f:  # the step's lines whole, or none
            append_line(
                f, path, "".join(lines), "held-out rollouts" if held_out else "sampled rollouts"
            )

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
