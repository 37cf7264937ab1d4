"""`quick_start_training`: the one-call API for a first RL experiment.

    from rollouts.training.quick_start import quick_start_training
    metrics = quick_start_training("path/to/hf-model", prompts, reward_fn, num_iterations=20)

It writes the prompts as a JSONL dataset in the run directory, builds a `Config` (defaults plus
`overrides`, the same keys as a TOML file), and runs the same RL phase as train.py: built-in
engines on the model, the AsyncRolloutManager, GRPO, weight sync every step.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from rollouts.config import config_from_dict
from rollouts.data.loaders import write_jsonl
from rollouts.training.run import rl_phase
from rollouts.training.run_setup import StopFlag, prepare_run_dir


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
) -> dict[str, float]:
    """Run `num_iterations` RL steps of `model_path` on `prompts`; the last step's metrics."""
    run_dir = Path(output_dir or tempfile.mkdtemp(prefix="rollouts-quick-"))
    data_path = run_dir / "data" / "prompts.jsonl"
    write_jsonl(data_path, _rows(prompts))
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
    prepare_run_dir(config, "quick_start_training", resume=False)
    return trio.run(rl_phase, config, run_dir, Path(model_path), False, StopFlag(), reward_fn)
