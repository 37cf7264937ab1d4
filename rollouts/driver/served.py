"""Models served beside the policy and never trained: the teacher of on-policy distillation
([teacher]) and the LLM judge ([judge]). Each has its model directory and its engines (a pool of
their own: built-in ones started here on its model, or servers at URLs), and is checked before
any step:

- the teacher's tokenizer is the student's (a token id must mean the same token on both sides,
  or its logprob is of another token): a mismatch is refused, naming the first id that differs
  (a judge reads text: its tokenizer is its own);
- every engine serves the model's weights: its prompt logprobs of a fixed probe equal those of
  the model at `<name>.path`, computed here once (the content check of a weight sync, with that
  model in place of the trainer).

The pools' health checks, stall detection and restarts are the policy pool's; weight syncs never
reach them (they are not the loop's pool)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from rollouts.config import Config
from rollouts.config.auto import engine_numerics
from rollouts.config.served import ServedModelConfig
from rollouts.driver.engines import open_engines
from rollouts.engine_kinds import engine_kind
from rollouts.inference.pool import EnginePool
from rollouts.models.sources import fetch_source
from rollouts.rollout.judge import Judge
from rollouts.rollout.teacher import Teacher
from rollouts.trainer.building import load_tokenizer
from rollouts.weights.check import (
    GAP_STATISTIC,
    WeightProbe,
    check_engines_at_start,
    probe_ids,
    tolerance_for,
)

SERVED_VERSION = "served"  # the weight version a teacher's or judge's engines report


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer is not the student's."""


def served_model_dir(section: ServedModelConfig) -> Path:
    """`<name>.path` as a local HF directory (`<name>.source` converted on first use)."""
    if section.source:
        return fetch_source(section.source, section.path or None)
    path = Path(section.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{section.KEY}.path = {section.path!r}: no HF model there (no config.json); point "
            f"it at the {section.KEY}'s model directory (a LoRA run's adapter: `rollouts models "
            "merge` first)"
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


def served_dtype(config: Config, section: ServedModelConfig) -> str:
    """The dtype a served model's engines compute in: the built-in engines' (their autocast's
    where one is on); servers at URLs: float32 (`<name>.check_tolerance` covers a bf16 one)."""
    e = section.engines
    if not engine_kind(e.kind).started_here:
        return "float32"
    b = e.builtin
    return engine_numerics(config, b)


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
        version=SERVED_VERSION,
        statistic=stat,
    )


async def check_served_engines(
    config: Config, section: ServedModelConfig, pool: EnginePool, model_dir: Path
) -> None:
    """Every engine of `pool` serves the model at `model_dir` (`WeightContentError` if not)."""
    name = section.KEY
    dtype = served_dtype(config, section)
    tolerance = tolerance_for(dtype, section.check_tolerance)
    ids = probe_ids(len(load_tokenizer(model_dir)), config.weight_sync.check_tokens, 0)
    probe = await trio.to_thread.run_sync(
        local_probe, model_dir, ids, tolerance, GAP_STATISTIC[dtype]
    )
    fix = (
        f"Start the {name}'s engines on {name}.path = {str(model_dir)!r} in the dtype they are "
        f"said to serve, or set {name}.check_tolerance."
    )
    await check_engines_at_start(pool.engines, probe, who=name, serves=str(model_dir), fix=fix)


@contextlib.asynccontextmanager
async def open_served(
    config: Config, section: ServedModelConfig
) -> AsyncIterator[tuple[EnginePool, Path] | None]:
    """`section`'s engines up and checked, and its model directory (None when it has no
    model); stopped on exit."""
    if not section.enabled:
        yield None
        return
    model_dir = served_model_dir(section)
    async with open_engines(
        dataclasses.replace(config, engines=section.engines),
        model_dir,
        SERVED_VERSION,
        (model_dir,),
        name=section.KEY,
        load_at_start=False,
    ) as pool:
        await check_served_engines(config, section, pool, model_dir)
        yield pool, model_dir


@contextlib.asynccontextmanager
async def open_teacher(config: Config, student_tokenizer: Any) -> AsyncIterator[Teacher | None]:
    """The teacher's engines up and checked (None without a [teacher]); stopped on exit."""
    if config.teacher.enabled:
        check_tokenizers(student_tokenizer, served_model_dir(config.teacher))
    async with open_served(config, config.teacher) as served:
        if served is None:
            yield None
            return
        yield Teacher(
            engines=served[0],
            max_concurrency=config.teacher.max_concurrency,
            top_k=config.algorithm.distill.top_k,
        )


@contextlib.asynccontextmanager
async def open_judge(config: Config) -> AsyncIterator[Judge | None]:
    """The judge's engines up and checked, as a reward (None without a [judge])."""
    async with open_served(config, config.judge) as served:
        if served is None:
            yield None
            return
        pool, model_dir = served
        yield Judge(engines=pool, tokenizer=load_tokenizer(model_dir), config=config.judge)
