"""`quick_start_training`: the one-call API for a first RL experiment.

    from rollouts.driver.quick_start import quick_start_training
    result = quick_start_training("path/to/hf-model", prompts, reward_fn, num_iterations=20)
    result.model_dir  # the trained model (HF format), result.metrics the last step's metrics

It builds a `Config` (defaults plus `overrides`, the same keys as a TOML file), (re)creates the
run directory (`output_dir`, replaced if it holds an earlier run; a new temporary directory
without it), writes the prompts there as a JSONL dataset, and runs the same RL phase as
train.py: built-in engines on the model, the AsyncRolloutManager, GRPO, weight sync every step.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from rollouts.config import config_from_dict
from rollouts.data.loaders import write_jsonl
from rollouts.driver.lock import hold_run_locks
from rollouts.driver.rl_phase import rl_phase
from rollouts.driver.setup import StopFlag, prepare_run_dir
from rollouts.driver.trainer_io import checkpoint_root
from rollouts.trainer.checkpoint import find_latest_checkpoint
from rollouts.trainer.lora import ADAPTER_DIR
from rollouts.trainer.pytorch import MODEL_DIR


def _rows(prompts: Sequence[str | Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            rows.append({"prompt": p})
        elif isinstance(p, Mapping) and ("prompt" in p or "messages" in p):
            rows.append(dict(p))
        else:
            raise ValueError(
                f"prompts[{i}] must be a string or a dict with 'prompt' or 'messages' "
                f"(and optionally 'label'); got {p!r}"
            )
    if not rows:
        raise ValueError("quick_start_training needs at least one prompt")
    return rows


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QuickStartResult:
    """Where a quick-start run left its work, and the last step's metrics."""

    metrics: dict[str, float]
    run_dir: Path  # metrics.jsonl, rollouts.jsonl, checkpoints/
    checkpoint: Path | None  # the final RL checkpoint (None: no step ran)

    @property
    def model_dir(self) -> Path | None:
        """The trained model (HF safetensors + tokenizer), loadable with from_pretrained (a LoRA
        run has one only with `model.lora.save_merged`)."""
        if self.checkpoint is None or not (self.checkpoint / MODEL_DIR).is_dir():
            return None
        return self.checkpoint / MODEL_DIR

    @property
    def adapter_dir(self) -> Path | None:
        """A LoRA run's trained adapter (PEFT's directory), or None."""
        if self.checkpoint is None or not (self.checkpoint / ADAPTER_DIR).is_dir():
            return None
        return self.checkpoint / ADAPTER_DIR


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def quick_start_training(
    model_path: str | Path,
    prompts: Sequence[str | Mapping[str, Any]],
    reward_fn: Callable[..., Any],
    num_iterations: int = 10,
    *,
    output_dir: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> QuickStartResult:
    """Run `num_iterations` RL steps of `model_path` on `prompts`; where the trained model is
    (printed too) and the last step's metrics. Calling it again with the same `output_dir`
    replaces the earlier run."""
    rows = _rows(prompts)
    run_dir = Path(output_dir or tempfile.mkdtemp(prefix="rollouts-quick-"))
    data_path = run_dir / "data" / "prompts.jsonl"
    table = _merge(
        {
            "run": {"output_dir": str(run_dir), "overwrite": True},
            "model": {"path": str(model_path)},
            "data": {"train_path": str(data_path)},
            "training": {"rl_steps": num_iterations},
            "rollout": {"batch_size": 4, "n_samples_per_prompt": 4},
        },
        overrides or {},
    )
    config = config_from_dict(table, "quick_start_training")
    with hold_run_locks(config):  # one run per directory; its weight copies gone at the end
        run_dir = prepare_run_dir(config, "quick_start_training", resume=False)
        write_jsonl(data_path, rows)  # after the run directory is (re)created, never before
        model = Path(model_path)
        metrics = trio.run(rl_phase, config, run_dir, model, False, StopFlag(), reward_fn)
    final = find_latest_checkpoint(checkpoint_root(config, run_dir, "rl"))
    result = QuickStartResult(metrics=metrics, run_dir=run_dir, checkpoint=final)
    trained = result.model_dir or result.adapter_dir
    print(f"[quick_start] run dir {run_dir}; trained model {trained}", flush=True)
    return result
