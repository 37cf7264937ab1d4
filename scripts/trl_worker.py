"""TRL's GRPOTrainer on a workload of scripts/bench_trl.py: runs in .venv-trl (scripts/trl_env.sh).

    .venv-trl/bin/python scripts/trl_worker.py SPEC.json RESULT.json

SPEC.json (written by bench_trl.py) names an HF model directory, a JSONL of prompts ({"prompt":
chat messages, "label": the gold answer, "prompt_ids": the project's token ids of the prompt}) and
the workload: prompts per step, samples per prompt, new tokens, temperature, lr, steps. TRL runs
with its own defaults otherwise (generation with `model.generate` on the whole batch, torch's
default thread count, the "dapo" token-level loss), set up so that each optimizer step generates
one batch and updates once: per_device_train_batch_size = prompts x samples, no gradient
accumulation, one iteration per batch, beta = 0 (no reference model).

The reward is the project's own `exact_match_reward`, imported from this checkout's source tree
(the project is not installed here; its module needs only trio). Before training, TRL's prompt
tokenization is checked against the project's ids: a mismatch is an error, since the two systems
would not see the same tokens.

RESULT.json holds one row per optimizer step: wall seconds from the end of the previous step
(the first from the start of training), the seconds in TRL's generate-and-score (generation,
rewards, advantages) and in `model.generate` alone, and what TRL logged (loss, grad_norm, reward,
completion length).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
import trl
from datasets import Dataset
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollouts.rewards.verifiers import exact_match_reward  # noqa: E402
from rollouts.types import Sample  # noqa: E402

CHECKED_PROMPTS = 16


def completion_text(completion: Any) -> str:
    """A TRL completion as text: a string, or the content of its last chat message."""
    if isinstance(completion, str):
        return completion
    assert completion and isinstance(completion[-1], dict), f"{completion=}"
    return str(completion[-1]["content"])


def exact_match(completions: list[Any], label: list[Any], **_: Any) -> list[float]:
    """The project's exact-match reward of each completion against its label."""
    assert len(completions) == len(label), f"{len(completions)=} != {len(label)=}"
    return [
        exact_match_reward(
            Sample(index=i, group_index=0, prompt="", label=gold, metadata={"response_text": t})
        )
        for i, (t, gold) in enumerate(zip(map(completion_text, completions), label, strict=True))
    ]


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (end to end) and the logs TRL writes after it."""

    def __init__(self) -> None:
        self.last = 0.0
        self.step_s: list[float] = []
        self.logs: list[dict[str, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self.last)
        self.last = now

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, int | float)})


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """`fn` that appends the seconds of each call to `into`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - started)
        return out

    return run


def grpo_config(spec: dict[str, Any], out_dir: Path) -> trl.GRPOConfig:
    """One generation batch per optimizer step, one update per batch, no reference model."""
    samples = spec["prompts_per_step"] * spec["samples_per_prompt"]
    return trl.GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["samples_per_prompt"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        beta=0.0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        max_grad_norm=spec["max_grad_norm"],
        max_steps=spec["steps"],
        seed=spec["seed"],
        model_init_kwargs={"dtype": spec["dtype"]},
        use_cpu=True,
        **({} if spec.get("bf16") is None else {"bf16": spec["bf16"]}),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def check_prompt_ids(trainer: trl.GRPOTrainer, rows: list[dict[str, Any]]) -> None:
    """TRL's token ids of the first prompts equal the project's (the same tokens go in)."""
    head = rows[:CHECKED_PROMPTS]
    ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in head])
    for row, got in zip(head, ids, strict=True):
        if list(got) != list(row["prompt_ids"]):
            raise SystemExit(
                f"TRL tokenizes prompt {row['prompt']!r} as {list(got)}; the project as "
                f"{row['prompt_ids']}: the systems would not see the same tokens"
            )


def main(spec_path: Path, result_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    assert rows, f"no prompt in {spec['prompts']}"
    data = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows])
    trainer = trl.GRPOTrainer(
        model=spec["model"],
        reward_funcs=exact_match,
        args=grpo_config(spec, result_path.parent / "trl-out"),
        train_dataset=data,
    )
    check_prompt_ids(trainer, rows)
    clock = StepClock()
    trainer.add_callback(clock)
    score_s: list[float] = []
    generate_s: list[float] = []
    trainer._generate_and_score_completions = timed(
        trainer._generate_and_score_completions, score_s
    )
    trainer._generate_single_turn = timed(trainer._generate_single_turn, generate_s)
    print(f"[trl] torch threads {torch.get_num_threads()}; {spec['steps']} steps", flush=True)
    trainer.train()
    n = len(clock.step_s)
    assert n == spec["steps"], f"{n=} steps timed, {spec['steps']} asked"
    assert len(score_s) == n and len(clock.logs) == n, f"{len(score_s)=} {len(clock.logs)=} {n=}"
    steps = [
        {"step_s": s, "score_s": sc, "generate_s": g, **log}
        for s, sc, g, log in zip(clock.step_s, score_s, generate_s, clock.logs, strict=True)
    ]
    result = {
        "steps": steps,
        "samples_per_step": trainer.args.per_device_train_batch_size,
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "dtype": str(next(trainer.model.parameters()).dtype),
        "bf16_autocast": bool(trainer.args.bf16),
    }
    result_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    assert len(sys.argv) == 3, "usage: trl_worker.py SPEC.json RESULT.json"
    main(Path(sys.argv[1]), Path(sys.argv[2]))
