"""On-policy distillation through train.py on the tiny model, as a user runs it: the teacher is
the shared finished run's base model, served by a built-in engine of its own; the student is that
model made overconfident (its LM head scaled up: the same greedy answers, far sharper
distributions). The teacher is checked at start (tokenizer, content) and evaluated once; the
student's samples carry the teacher's opinion, and the student moves toward it (its reverse KL
falls, its entropy rises toward the teacher's)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from tests.training.conftest import FinishedRun
from tests.training.test_train_e2e import _config, _train

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

RL_STEPS = 4


def _distill_config(tmp: Path, student: Path, teacher: Path, **sections: dict) -> Path:
    return _config(
        tmp,
        model={"path": str(student)},
        model__tiny={"enabled": False},
        training={"rl_steps": RL_STEPS, "micro_batch_tokens": 4096},
        optim={"lr": 1e-2, "scheduler": "constant"},
        rollout={
            "batch_size": 4,
            "n_samples_per_prompt": 4,
            "over_sampling_factor": 1.0,
            "reward_fn": "rollouts.rewards.verifiers.exact_match_reward",
        },
        algorithm={"advantage": "distill"},
        teacher={"path": str(teacher)},
        **{"teacher.engines.builtin": {"max_batch": 16}},
        checkpoint={"every": 0},
        **sections,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sharpened(base: Path, out: Path, scale: float = 20.0) -> Path:
    """`base` with its LM head times `scale`: every argmax kept, every distribution sharper."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def test_distilling_into_an_overconfident_student(tmp_path: Path, finished_run: FinishedRun):
    teacher = finished_run.root / "base"
    student = _sharpened(teacher, tmp_path / "student")
    done = _train("--mode", "rl", "--config", str(_distill_config(tmp_path, student, teacher)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[teacher] http://127.0.0.1:" in done.stdout and f"serves {teacher}" in done.stdout
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(RL_STEPS + 1))
    # greedy answers are the argmax's, the same for both: so are their held-out accuracies
    assert metrics[0]["teacher/eval/accuracy"] == metrics[0]["eval/accuracy"]
    assert metrics[0]["teacher/eval/scored"] == metrics[0]["eval/scored"] > 0
    kls = [m["distill/reverse_kl"] for m in metrics[1:]]
    assert all(math.isfinite(k) for k in kls), kls
    assert all(m["distill/scored_tokens"] > 0 for m in metrics[1:])
    assert kls[-1] < kls[0] * 0.8, kls  # the student moves toward the teacher
    entropies = [m["train/entropy"] for m in metrics[1:]]
    assert entropies == sorted(entropies), entropies
    rows = _lines(tmp_path / "run" / "rollouts.jsonl")
    assert rows and all(math.isfinite(r["reverse_kl"]) for r in rows)
    assert not any(k.startswith("rollout/teacher_failed") for m in metrics for k in m)


def test_a_teacher_of_another_tokenizer_is_refused_at_start(
    tmp_path: Path, finished_run: FinishedRun
) -> None:
    spec = TinyModelSpec(tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2)
    other = make_tiny_model(tmp_path / "bpe-teacher", spec, corpus=["12 + 34 = 46"] * 50)
    student = finished_run.root / "base"
    done = _train("--mode", "rl", "--config", str(_distill_config(tmp_path, student, other)))
    assert done.returncode != 0
    assert "its tokenizer is not the student's: token id" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run" / "engines").exists()  # refused before any engine started


def test_a_judge_whose_answers_never_parse_stops_the_run_saying_why(
    tmp_path: Path, finished_run: FinishedRun
) -> None:
    """The judge is the tiny model (it answers noise): it is started, checked and asked, every
    sample FAILED as reward/unparsed, nothing is trained on a 0, and the run stops naming it."""
    base = finished_run.root / "base"
    config = _config(
        tmp_path,
        model={"path": str(base)},
        training={"rl_steps": 2},
        rollout={"reward_fn": "judge", "over_sampling_factor": 1.0},
        judge={"path": str(base), "max_new_tokens": 4, "template": "{response}?", "chat": False},
        **{"judge.engines.builtin": {"max_batch": 16}},
        checkpoint={"every": 0},
    )
    done = _train("--mode", "rl", "--config", str(config))
    assert done.returncode != 0
    assert "[judge] http://127.0.0.1:" in done.stdout and f"serves {base}" in done.stdout
    console = done.stdout + done.stderr
    assert "reward unparsed" in console, console[-3000:]
    assert "the judge's answer has no score" in console
    assert (tmp_path / "run" / "engines" / "judge-0.log").is_file()
