"""The root `Config` and the TOML loader: walk a table against the dataclass fields and collect
EVERY problem into one `ConfigError`; `--set` overrides; back to a plain dict.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollouts.config.algorithm import ALGORITHM_MOVED_KEYS, AlgorithmConfig
from rollouts.config.base import (
    ConfigError,
    _check,
    _Section,
    config_fields,
    is_literal,
    literal_problem,
)
from rollouts.config.data import DataConfig
from rollouts.config.model import ModelConfig, RunSection
from rollouts.config.reward import RewardConfig
from rollouts.config.rollout import EnginesConfig, RolloutConfig, engine_logprobs
from rollouts.config.served import JudgeConfig, TeacherConfig
from rollouts.config.training import CheckpointConfig, LoggingConfig, OptimConfig, TrainingConfig
from rollouts.config.weight_sync import WeightSyncConfig
from rollouts.engine_kinds import engine_kind


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config(_Section):
    """The whole run: one frozen tree, built once in train.py and passed down."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    engines: EnginesConfig = dataclasses.field(default_factory=EnginesConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)

    def problems(self) -> list[str]:
        return (
            lora_problems(self)
            + sleep_problems(self)
            + layout_problems(self)
            + logprob_problems(self)
            + distill_problems(self)
            + judge_problems(self)
        )


def judge_problems(config: Config) -> list[str]:
    """`rollout.reward_fn = "judge"` and a [judge] need each other."""
    asked = config.rollout.reward_fn == JUDGE_REWARD
    p: list[str] = []
    _check(
        p,
        config.judge.enabled or not asked,
        "rollout.reward_fn = 'judge' needs a judge: set judge.path (an HF model directory) or "
        "judge.source, and [judge.engines]",
    )
    _check(
        p,
        asked or not config.judge.enabled,
        f"judge.path / judge.source is set but rollout.reward_fn = {config.rollout.reward_fn!r}: "
        "nothing would ask the judge; set rollout.reward_fn = 'judge', or remove [judge]",
    )
    return p


JUDGE_REWARD = "judge"  # rollout.reward_fn naming the [judge] as the reward


def distill_problems(config: Config) -> list[str]:
    """What on-policy distillation needs: a teacher for advantage = "distill" and no teacher
    without it, and the student's logprobs of the distribution it sampled from (the raw
    logits' at temperature 1; the trainer's are the raw ones)."""
    distill = config.algorithm.advantage == "distill"
    teacher = config.teacher.enabled
    p: list[str] = []
    _check(
        p,
        teacher or not distill,
        "algorithm.advantage = 'distill' needs a teacher: set teacher.path (an HF model "
        "directory) or teacher.source, and [teacher.engines]",
    )
    _check(
        p,
        distill or not teacher,
        f"teacher.path / teacher.source is set but algorithm.advantage = "
        f"{config.algorithm.advantage!r}: nothing would use the teacher; set "
        "algorithm.advantage = 'distill' (algorithm.distill.task_advantage mixes in the "
        "reward's), or remove [teacher]",
    )
    temperature = config.rollout.sampling.temperature
    _check(
        p,
        not distill or temperature in (0.0, 1.0) or engine_logprobs(config.engines) == "raw",
        f"algorithm.advantage = 'distill' at rollout.sampling.temperature = {temperature}: the "
        f"{config.engines.kind} engines' logprobs are of the temperature-scaled distribution, "
        "the teacher's of the raw logits, so the reverse KL would compare two different "
        f"temperatures; {engine_kind(config.engines.kind).raw_logprobs}; or sample at 1.0",
    )
    return p


def logprob_problems(config: Config) -> list[str]:
    """Rollout correction (TIS, rejection) weighs each token by pi_trainer / pi_engine: both
    logprobs must be of the same distribution. The trainer's are of the raw logits; an engine
    whose logprobs are of the temperature-scaled ones would make every weight
    pi_1 / pi_T at a temperature T other than 1 (below 1 on the likely tokens when T < 1),
    silently."""
    engines = config.engines
    temperature = config.rollout.sampling.temperature
    correction = config.algorithm.rollout_correction
    if not correction.enabled or temperature in (0.0, 1.0) or engine_logprobs(engines) == "raw":
        return []
    fix = engine_kind(engines.kind).raw_logprobs
    return [
        f"algorithm.rollout_correction (tis = {correction.tis}, rejection = "
        f"{correction.rejection!r}) at rollout.sampling.temperature = {temperature}: the "
        f"{engines.kind} engines' logprobs are of the temperature-scaled distribution, the "
        "trainer's of the raw logits, so every correction weight would be pi_1 / "
        f"pi_{temperature:g} instead of pi_trainer / pi_engine; {fix}; or sample at "
        "temperature 1.0; or turn the correction off"
    ]


def layout_problems(config: Config) -> list[str]:
    """What training.micro_batch_layout = "prefix" needs of [model]."""
    p: list[str] = []
    _check(
        p,
        config.training.micro_batch_layout != "prefix" or not config.model.gradient_checkpointing,
        "training.micro_batch_layout = 'prefix' with model.gradient_checkpointing = true: a "
        "layer recomputed in the backward pass would write its keys to the prefix's KV cache "
        "again; set micro_batch_layout = 'pad', or gradient_checkpointing = false",
    )
    return p


def sleep_problems(config: Config) -> list[str]:
    """What engines.sleep_level needs of the other sections (nothing when it is 0)."""
    level = config.engines.sleep_level
    if not level:
        return []
    p: list[str] = []
    kind = config.engines.kind
    _check(
        p,
        engine_kind(kind).sleeps,
        f"engines.sleep_level = {level} with engines.kind = {kind!r}: its servers have no sleep "
        "routes; set engines.sleep_level = 0",
    )
    _check(
        p,
        config.rollout.mode == "sync",
        f"engines.sleep_level = {level} with rollout.mode = 'async': async engines generate "
        "while the trainer trains; set rollout.mode = 'sync', or engines.sleep_level = 0",
    )
    _check(
        p,
        config.weight_sync.every == 1,
        f"engines.sleep_level = {level} with weight_sync.every = {config.weight_sync.every}: "
        "a woken engine gets its weights from the step's sync; set weight_sync.every = 1",
    )
    return p


def lora_problems(config: Config) -> list[str]:
    """What [model.lora] needs of the other sections (nothing when it is off)."""
    if not config.model.lora.enabled:
        return []
    p: list[str] = []
    _check(
        p,
        config.algorithm.reference.update == "none",
        f"model.lora.enabled with algorithm.reference.update = "
        f"{config.algorithm.reference.update!r}: with LoRA the reference is the base model "
        "(the adapter switched off), which never moves; set algorithm.reference.update = 'none'",
    )
    ws = config.weight_sync
    _check(
        p,
        ws.lora == "merged" or ws.method == "disk",
        "weight_sync.lora = 'adapter' with weight_sync.method = 'distributed': adapters go "
        "to the engines as files (a few MB); set weight_sync.method = 'disk', or "
        "weight_sync.lora = 'merged' to broadcast the merged weights",
    )
    return p


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    if is_literal(tp):  # a mode: one of its values
        problem = literal_problem(key, value, tp)
        if problem:
            problems.append(problem)
        return value
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{key} = {value!r}: must be a list of {_type_name(item_tp)}")
            return value
        if dataclasses.is_dataclass(item_tp):  # an array of tables: [[data.sources]]
            return [_table(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return [_coerce(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            sub: list[str] = []
            out = _coerce(value, option, key, sub)
            if not sub:
                return out
        problems.append(f"{key} = {value!r}: must be {tp}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        problems.append(f"{key} = {value!r}: must be {_type_name(tp)}, got {type(value).__name__}")
    return value


def _table(value: Any, cls: type, path: str, problems: list[str]) -> Any:
    """One table of an array of tables, built as section `cls` (problems named `path.key`)."""
    if not isinstance(value, dict):
        problems.append(f"{path}: must be a table, got {type(value).__name__}")
        return cls()
    return _build(cls, value, f"{path}.", problems)


def _build(cls: type, table: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    """Build section `cls` from `table`, appending every problem found (with key paths)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in config_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            valid = ", ".join(sorted(fields))
            problems.append(f"{path}: unknown key{hint}; valid keys here: {valid}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{path}: must be a table [{path}], got {type(value).__name__}")
                continue
            kwargs[key] = _build(tp, value, f"{path}.", problems)
        else:
            before = len(problems)
            coerced = _coerce(value, tp, path, problems)
            if len(problems) == before:  # a badly typed value is reported, not range-checked
                kwargs[key] = coerced
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section nested elsewhere ([teacher.engines]): its own path
        key = getattr(cls, "KEY", "")
        moved = key and prefix and prefix != f"{key}."
        problems.extend(p.replace(f"{key}.", prefix) if moved else p for p in e.problems)
    except (TypeError, AssertionError) as e:
        problems.append(f"{prefix or 'config'}: {e}")
    return cls()  # a placeholder so that the walk goes on; the error is raised by the caller


# Keys that moved: old dotted path -> new one. The old key keeps working for one release; each use
# prints a line naming the new key. Given both ways, it is an error.
MOVED_KEYS: dict[str, str] = {
    "training.sync_every": "weight_sync.every",
    "training.weight_sync_dir": "weight_sync.dir",
    "training.weight_sync_attempts": "weight_sync.attempts",
    "weight_sync.backend": "weight_sync.distributed.backend",
    "weight_sync.bucket_mb": "weight_sync.distributed.bucket_mb",
    "weight_sync.master_address": "weight_sync.distributed.master_address",
    "weight_sync.master_port": "weight_sync.distributed.master_port",
    "weight_sync.group_name": "weight_sync.distributed.group_name",
    "weight_sync.timeout_s": "weight_sync.distributed.timeout_s",
    "engines.num_engines": "engines.builtin.num_engines",
    "engines.max_batch": "engines.builtin.max_batch",
    "engines.max_queue": "engines.builtin.max_queue",
    "engines.logprobs_from": "engines.builtin.logprobs_from",
    "engines.device": "engines.builtin.device",
    "engines.torch_threads": "engines.builtin.torch_threads",
    "engines.max_restarts": "engines.builtin.max_restarts",
}


def _pop_path(table: dict[str, Any], path: list[str]) -> tuple[bool, Any]:
    node: Any = table
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or path[-1] not in node:
        return False, None
    return True, node.pop(path[-1])


def move_old_keys(
    table: Mapping[str, Any], problems: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """A copy of `table` with every key of `MOVED_KEYS` (and `ALGORITHM_MOVED_KEYS`) at its new
    place; the notes to print."""
    out = copy.deepcopy(dict(table))
    notes: list[str] = []
    for old, new in (MOVED_KEYS | ALGORITHM_MOVED_KEYS).items():
        found, value = _pop_path(out, old.split("."))
        if not found:
            continue
        *parents, leaf = new.split(".")
        node: Any = out
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            problems.append(f"{old} is now {new}, but {'.'.join(parents)} is not a table")
            continue
        if leaf in node:
            problems.append(f"{old} and {new} are both set: {old} is the old name; keep only {new}")
            continue
        node[leaf] = value
        notes.append(f"[config] {old} is now {new}: the old key works until the next release")
    return out, notes


def config_from_dict(table: Mapping[str, Any], source: str = "") -> Config:
    """Build and validate a `Config` from a plain dict (parsed TOML); a key that moved
    (`MOVED_KEYS`) is read at its new place, with a line on stderr naming the new key."""
    problems: list[str] = []
    table, notes = move_old_keys(table, problems)
    for note in notes:
        print(f"{note}{f' ({source})' if source else ''}", file=sys.stderr, flush=True)
    config = _build(Config, table, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return config


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError([f"--set {text!r}: must look like section.key=value"])
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string: --set run.name=demo
    return key.strip().split("."), value


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides (values parsed as TOML, else taken as strings)."""
    for text in overrides:
        path, value = _parse_override(text)
        node = table
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {text!r}: {part} is not a table"])
        node[path[-1]] = value
    return table


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML file into a validated `Config`; `overrides` are `key.path=value` strings."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such config file"])
    try:
        table = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: invalid TOML: {e}"], str(path)) from e
    table = apply_overrides(table, overrides or [])
    return config_from_dict(table, str(path))


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as a plain dict of its keys (for writing the resolved config of a run)."""
    return {f.name: _plain(getattr(config, f.name)) for f in config_fields(config)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)
