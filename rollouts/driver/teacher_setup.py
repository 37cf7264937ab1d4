"""The teacher of on-policy distillation ([teacher]): its model directory, its engines (a pool
of their own: built-in ones started here on the teacher's model, or servers at URLs), and the
two checks before any step:

- its tokenizer is the student's (a token id must mean the same token on both sides, or its
  logprob is of another token): a mismatch is refused, naming the first id that differs;
- every engine serves the teacher's weights: its prompt logprobs of a fixed probe equal those
  of the model at `teacher.path`, computed here once (the content check of a weight sync, with
  the teacher's model in place of the trainer).

The pool's health checks, stall detection and restarts are the policy pool's; weight syncs never
reach it (it is not the loop's pool)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from rollouts.config import Config
from rollouts.driver.engines import open_engines
from rollouts.engine_kinds import engine_kind
from rollouts.inference.pool import EnginePool
from rollouts.models.sources import fetch_source
from rollouts.rollout.teacher import Teacher
from rollouts.trainer.building import load_tokenizer
from rollouts.weights.check import (
    GAP_STATISTIC,
    WeightContentError,
    WeightProbe,
    check_engine,
    probe_ids,
    tolerance_for,
)

TEACHER_VERSION = "teacher"


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer is not the student's."""


def teacher_model_dir(config: Config) -> Path:
    """`teacher.path` as a local HF directory (`teacher.source` converted on first use)."""
    t = config.teacher
    if t.source:
        return fetch_source(t.source, t.path or None)
    path = Path(t.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"teacher.path = {t.path!r}: no HF model there (no config.json); point it at the "
            "teacher's model directory (a LoRA run's adapter: `rollouts models merge` first)"
        )
    return path


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Where two tokenizers differ: the first token id whose token is not the same (or the
    sizes), as a sentence; None when they agree."""
    n_s, n_t = len(student), len(teacher)
    ids = list(range(min(n_s, n_t)))
    s_tokens = student.convert_ids_to_tokens(ids)
    t_tokens = teacher.convert_ids_to_tokens(ids)
    for i, (a, b) in enumerate(zip(s_tokens, t_tokens, strict=True)):
        if a != b:
            return f"token id {i} is {a!r} for the student and {b!r} for the teacher"
    if n_s != n_t:
        k = min(n_s, n_t)
        longer, other, tok = (
            ("student", "teacher", student) if n_s > n_t else ("teacher", "student", teacher)
        )
        token = tok.convert_ids_to_tokens([k])[0]
        return (
            f"token id {k} is {token!r} for the {longer} and none for the {other} (the student "
            f"has {n_s} tokens, the teacher {n_t})"
        )
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} is {a} for the student and {b} for the teacher"
    return None


def check_tokenizers(student: Any, teacher_dir: Path) -> None:
    """Refuse a teacher whose tokenizer is not the student's (`TokenizerMismatch`)."""
    found = tokenizer_mismatch(student, load_tokenizer(teacher_dir))
    if found is not None:
        raise TokenizerMismatch(
            f"teacher.path = {str(teacher_dir)!r}: its tokenizer is not the student's: {found}. "
            "Distillation compares the two models' logprobs of the same token ids; use a teacher "
            "of the student's family (the same tokenizer)"
        )


def served_dtype(config: Config) -> str:
    """The dtype the teacher's engines compute in: the built-in engines' (their autocast's
    where one is on); servers at URLs: float32 (teacher.check_tolerance covers a bf16 one)."""
    e = config.teacher.engines
    if not engine_kind(e.kind).started_here:
        return "float32"
    b = e.builtin
    return b.dtype if b.autocast == "off" else b.autocast


def local_probe(model_dir: Path, ids: tuple[int, ...], tolerance: float, stat: str) -> WeightProbe:
    """The logprobs of `ids` by the model at `model_dir`, loaded here in float32 and freed."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids_T = torch.tensor(ids, dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids_T[None]).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids_T[1:, None]).squeeze(1)
    del model
    return WeightProbe(
        ids=ids,
        expected=tuple(float(x) for x in logprobs.tolist()),
        tolerance=tolerance,
        version=TEACHER_VERSION,
        statistic=stat,
    )


async def check_teacher_engines(config: Config, pool: EnginePool, model_dir: Path) -> None:
    """Every teacher engine serves the model at `model_dir` (`WeightContentError` if not)."""
    dtype = served_dtype(config)
    tolerance = tolerance_for(dtype, config.teacher.check_tolerance)
    ids = probe_ids(len(load_tokenizer(model_dir)), config.weight_sync.check_tokens, 0)
    probe = await trio.to_thread.run_sync(
        local_probe, model_dir, ids, tolerance, GAP_STATISTIC[dtype]
    )
    errors: list[str] = []
    for engine in pool.engines:
        try:
            gap = await check_engine(engine, probe)
        except WeightContentError as e:
            errors.append(str(e))
            continue
        print(f"[teacher] {engine.url} serves {model_dir} (gap {gap:.2g})", flush=True)
    if errors:
        raise WeightContentError(
            "the teacher at start: " + "\n".join(errors) + f"\nStart the teacher's engines on "
            f"teacher.path = {str(model_dir)!r} in the dtype they are said to serve, or set "
            "teacher.check_tolerance."
        )


def teacher_engines_config(config: Config) -> Config:
    """`config` with the teacher's engines in place of the policy's (for `open_engines`)."""
    return dataclasses.replace(config, engines=config.teacher.engines)


@contextlib.asynccontextmanager
async def open_teacher(config: Config, student_tokenizer: Any) -> AsyncIterator[Teacher | None]:
    """The teacher's engines up and checked (None without a [teacher]); stopped on exit."""
    if not config.teacher.enabled:
        yield None
        return
    model_dir = teacher_model_dir(config)
    check_tokenizers(student_tokenizer, model_dir)
    async with open_engines(
        teacher_engines_config(config),
        model_dir,
        TEACHER_VERSION,
        (model_dir,),
        name="teacher",
        load_at_start=False,
    ) as pool:
        await check_teacher_engines(config, pool, model_dir)
        yield Teacher(engines=pool, max_concurrency=config.teacher.max_concurrency)
