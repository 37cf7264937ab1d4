"""The built-in engine's options, declared once: `EngineOptions`.

Each field is one option, with its type (a `Literal` is a mode: the flag's choices), default,
help text and bounds (`option`). Three things are made from the fields:
- the config section [engines.builtin]: the fields marked `key` (the others are set by the run
  for each engine it starts: the model, the port, the weight version ...);
- the flags of `rollouts serve` (`rollouts/engine/cli.py`): every field marked `flag`, as
  `--the-name` (`flag_of`; a bool is `on|off`, a tuple a repeated flag or a comma list);
- the command line the run starts an engine with (`command_line`, `rollouts/engine/launch.py`).
A value out of bounds is one problem, named as the config key or as the flag (`bound_problems`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from rollouts.config.base import _Section
from rollouts.config.model import AttnImplementation
from rollouts.engine_kinds import LogprobsFrom

# the engine's numerics (precision.py); "auto": config/auto.py
EngineAutocast = Literal["auto", "off", "bfloat16", "float16"]
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]  # "auto": config/auto.py
DecodePath = Literal[
    "auto", "eager", "hf"
]  # the engine's own step (graphs on a GPU) | no graphs | HF


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """What a field of `EngineOptions` is besides its type and default."""

    help: str
    key: bool = False  # a key of [engines.builtin]
    flag: bool = True  # an option of `rollouts serve`
    name: str = ""  # the flag's name when it is not the field's (`--weights-root`)
    sep: str = ""  # a tuple given as one flag, its items joined by `sep` (else: the flag repeated)
    switch: bool = False  # a bool flag that takes no value (store_true) instead of on|off
    required: bool = False  # `rollouts serve` refuses to start without it
    at_least: float | None = None
    above: float | None = None


def option(default: Any, help: str, **what: Any) -> Any:
    """A field of `EngineOptions`: its default, help text and bounds (`Option`)."""
    meta = Option(help=help, **what)
    return dataclasses.field(default=default, metadata={"option": meta, "config_key": meta.key})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions(_Section):
    """[engines.builtin]: the `rollouts serve` processes the run starts (engines.kind =
    "builtin"; read only then), and every option one of them takes."""

    KEY: ClassVar[str] = "engines.builtin"

    model: str = option("", "HF-format model directory", required=True)
    host: str = option("127.0.0.1", "bind address (default loopback)")
    port: int = option(30000, "the port to serve on (the run's engines: 0 = a free one)")
    api_key: str = option("", "require 'Authorization: Bearer KEY'")
    allow_unauthenticated: bool = option(
        False,
        "serve a non-loopback --host without --api-key (anyone who reaches the port can "
        "generate, pause, abort and reload weights)",
        switch=True,
    )
    weights_roots: tuple[str, ...] = option(
        (),
        "weight reloads only from inside DIR (repeatable); without it, from any path",
        name="weights-root",
    )
    max_body_mb: float = option(64.0, "larger request bodies get 413", above=0)
    num_engines: int = option(1, "engines the run starts", key=True, flag=False, at_least=1)
    max_restarts: int = option(
        3,
        "an engine that exits is restarted at most this many times (0 = never restart)",
        key=True,
        flag=False,
        at_least=0,
    )
    max_batch: int = option(
        128,
        "sequences decoded together (every shipped CPU config decodes its 128 a step at once; "
        "the KV cache is allocated for this many rows)",
        key=True,
        at_least=1,
    )
    max_queue: int = option(1024, "waiting sequences; then 503", key=True, at_least=1)
    max_prefill: int = option(64, "new sequences per step", at_least=1)
    logprobs_from: LogprobsFrom = option(
        "raw",
        "logprob of a sampled token from the raw logits or the temperature-scaled ones",
        key=True,
    )
    device: str = option("cpu", "the device the model runs on", key=True)
    dtype: EngineDtype = option(
        "auto",
        "the served weights' dtype; bfloat16 serves what a bf16 trainer computes (the weight "
        "sync's content check then allows bf16's tolerance). 'auto': a run's engines hold bf16 "
        "weights where training.autocast resolves to bf16, else the trainer's model.dtype "
        "(config/auto.py); a standalone server float32",
        key=True,
    )
    autocast: EngineAutocast = option(
        "auto",
        "compute what a trainer under torch.autocast in this dtype computes (with dtype "
        "float32): linear weights held in it, embeddings, norms and the residual stream float32, "
        "every forward under autocast; about a 16-bit engine's speed on CPU. 'auto': a run's "
        "engines follow training.autocast (config/auto.py); a standalone server computes in "
        "its dtype",
        key=True,
    )
    attn_implementation: AttnImplementation = option(
        "sdpa",
        "the HF forward's attention (prefill, prompt logprobs): the trainer's, so that a "
        "16-bit engine computes its function (the engine's own decode step is eager's)",
    )
    decode: DecodePath = option(
        "auto",
        "decode steps: 'auto' = the engine's own step for Llama and Qwen2 models (the HF "
        "forward for others), replayed as CUDA graphs on a GPU; 'eager' = the same step without "
        "graphs; 'hf' = always the HF forward",
    )
    share_prefix: bool = option(
        True,
        "prefill the token prefix that new prompts share (an agent's system message, a "
        "group's question) once, and keep it for the next ones while the weights stay: 'off' "
        "prefills every prompt whole",
    )
    weight_version: str = option("default", "the weight version served at start")
    served_model_name: str = option("", "the model's name in OpenAI answers (default: --model)")
    request_timeout_s: float = option(600.0, "a request's time limit", above=0)
    log_level: str = option("INFO", "the server's log level")
    torch_threads: int = option(
        0,
        "torch intra-op threads (0 = torch's default, or a share of the cores for the run's "
        "engines on CPU); 1 avoids OpenMP spin-waits when the server shares a few CPU cores "
        "with a trainer",
        key=True,
        at_least=0,
    )
    adapt_threads: bool = option(
        False,
        "on CPU with several torch threads, try one thread now and then and keep it while its "
        "decode steps are faster: an OpenMP team beside another busy process slows to a "
        "fraction of one thread's speed (engine/threads.py); off by default: on the quiet "
        "2-core box it cost 3-10% and beside a busy process it gained 0-9%",
        key=True,
    )
    cpus: tuple[int, ...] = option(
        (),
        "run on these CPU cores only, e.g. 1 or 2,3 (Linux; default: all the process may use)",
        sep=",",
    )

    def problems(self) -> list[str]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return bound_problems(values, lambda name: f"{self.KEY}.{name}")


def option_of(field: dataclasses.Field) -> Option:
    """The `Option` of a field of `EngineOptions`."""
    meta = field.metadata.get("option")
    assert isinstance(meta, Option), f"{field.name} is not declared with `option`"
    return meta


def flag_of(field: dataclasses.Field) -> str:
    """`--max-batch` for the field `max_batch`."""
    return "--" + (option_of(field).name or field.name.replace("_", "-"))


def flag_name(name: str) -> str:
    """The flag of the field of `EngineOptions` called `name`, for messages."""
    (field,) = [f for f in dataclasses.fields(EngineOptions) if f.name == name]
    return flag_of(field)


def _bound(value: Any, meta: Option) -> str | None:
    if meta.at_least is not None and value < meta.at_least:
        return f"must be >= {meta.at_least:g}"
    if meta.above is not None and value <= meta.above:
        return f"must be > {meta.above:g}"
    return None


def bound_problems(values: Mapping[str, Any], name: Callable[[str], str]) -> list[str]:
    """Each of the options `values` out of its bounds, and an autocast without fp32 weights,
    naming each field as `name(field)` says: the config's key path, or the flag of `rollouts
    serve`."""
    out = [
        f"{name(f.name)} = {values[f.name]}: {why}"
        for f in dataclasses.fields(EngineOptions)
        if (why := _bound(values[f.name], option_of(f))) is not None
    ]
    autocast, dtype = values["autocast"], values["dtype"]
    if autocast not in ("off", "auto") and dtype not in ("float32", "auto"):
        out.append(
            f'{name("autocast")} = "{autocast}" needs {name("dtype")} = "float32" '
            f'(autocast reads fp32 weights), not "{dtype}"'
        )
    return out


def _text(value: Any, meta: Option) -> list[str]:
    """A flag's value(s) on a command line."""
    if isinstance(value, bool):
        return [] if meta.switch else ["on" if value else "off"]
    if isinstance(value, tuple):
        return [meta.sep.join(map(str, value))] if meta.sep else [str(v) for v in value]
    return [str(value)]


def command_line(options: EngineOptions) -> list[str]:
    """The flags of `rollouts serve` that start an engine with `options` (the model's, and every
    flag whose value is not its default)."""
    out: list[str] = []
    for f in dataclasses.fields(options):
        meta, value = option_of(f), getattr(options, f.name)
        if not meta.flag or (value == f.default and not meta.required):
            continue
        values = _text(value, meta)
        if isinstance(value, tuple) and not meta.sep:
            out += [a for v in values for a in (flag_of(f), v)]
        else:
            out += [flag_of(f), *values]
    return out


def choices_of(tp: Any) -> tuple[Any, ...]:
    """A mode's values (`Literal`), or () for another type."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
