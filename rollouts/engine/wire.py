"""Parsing the wire formats into SamplingSpecs: pure, and strict (unknown keys are 400s).

SGLang puts sampling in `sampling_params` (names as in `SamplingSpec`, `n` inside it, seed as
`sampling_seed`); the OpenAI-compatible routes put them at the top level with vLLM's names
(`max_tokens` default 16, `include_stop_str_in_output`, `seed`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from rollouts.engine.sampling import (
    BadRequest,
    SamplingSpec,
    as_int_list,
    as_str_list,
    as_type,
    check_spec,
)

# wire name -> (SamplingSpec field, type): the names both formats share, then each one's own
_SHARED_PARAMS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "stop": ("stop", "str_list"),
    "stop_token_ids": ("stop_token_ids", "int_list"),
    "ignore_eos": ("ignore_eos", bool),
    "skip_special_tokens": ("skip_special_tokens", bool),
}
SGLANG_PARAMS: dict[str, tuple[str, Any]] = {
    "max_new_tokens": ("max_new_tokens", int),
    **_SHARED_PARAMS,
    "no_stop_trim": ("no_stop_trim", bool),
    "sampling_seed": ("seed", int),
}
OPENAI_PARAMS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("max_new_tokens", int),
    "max_completion_tokens": ("max_new_tokens", int),
    **_SHARED_PARAMS,
    "include_stop_str_in_output": ("no_stop_trim", bool),
    "seed": ("seed", int),
}
# accepted only at their neutral value (the built-in server does not implement them)
NEUTRAL = {
    "min_new_tokens": 0,
    "min_tokens": 0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
    "spaces_between_special_tokens": "any",
    "stream": False,
    "echo": False,
    "prompt_logprobs": None,  # /v1/chat/completions (/v1/completions computes them)
    "best_of": None,
    "user": "any",
    "model": "any",
    "stream_options": None,
    "chat_template_kwargs": "any",
}


# SGLang's GenerateReqInput fields the built-in server reads (besides the prompt fields)
GENERATE_KEYS = {
    "lora_path",  # the name of a loaded LoRA adapter (or a list, one per prompt)
    "text",
    "input_ids",
    "input_embeds",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "return_prompt_token_ids",
    "stream",
}
# GenerateReqInput fields that only route, label or log a request: accepted, no effect here
GENERATE_METADATA = {
    "log_metrics",
    "priority",
    "extra_key",
    "routing_key",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
    "conversation_id",
    "no_logs",
    "custom_labels",
    "external_trace_header",
    "received_time",
    "http_worker_ipc",
    "modalities",
    "routed_experts_start_len",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
    "decode_tp_size",
}
# GenerateReqInput features the built-in server lacks: accepted only when null, false or empty
GENERATE_UNSUPPORTED = {
    "image_data",
    "video_data",
    "audio_data",
    "use_audio_in_video",
    "token_ids_logprob",
    "return_hidden_states",
    "return_routed_experts",
    "return_indexer_topk",
    "session_params",
    "lora_id",
    "custom_logit_processor",
    "positional_embed_overrides",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "require_reasoning",
    "background",
    "return_bytes",
    "return_entropy",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "multi_item_delimiter_indices",
}
INT64 = (-(2**63), 2**63 - 1)
SEED_RANGE = (-(2**63), 2**64 - 1)  # signed or unsigned 64-bit (`sampling.seed_as_int64`)


def unknown_key(name: str, known: set[str]) -> BadRequest:
    """A 400 for a key the route does not know, naming the closest known key if any."""
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return BadRequest(name, f"unknown key{hint}")


def check_generate_keys(body: Mapping[str, Any]) -> None:
    """/generate: an unknown top-level key (a typo such as `return_logprobs`) is a 400, and a
    feature the built-in server lacks is a 400 unless it is off (null, false or empty)."""
    known = GENERATE_KEYS | GENERATE_METADATA | GENERATE_UNSUPPORTED
    for key, value in body.items():
        if key in GENERATE_UNSUPPORTED and value not in (None, False, [], {}, ""):
            raise BadRequest(key, "is not supported by the built-in server")
        if key not in known:
            raise unknown_key(key, known)


def _convert(field: str, value: Any, kind: Any) -> Any:
    if kind == "str_list":
        return as_str_list(field, value)
    if kind == "int_list":
        ids = as_int_list(field, value)
        if any(not INT64[0] <= t <= INT64[1] for t in ids):
            raise BadRequest(field, "token ids must fit in 64 bits")
        return ids
    if value is None:
        raise BadRequest(field, "must not be null")
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    value = as_type(field, value, kind)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(field, f"{value!r} must be a finite number")
    low, high = SEED_RANGE if field.endswith("seed") else INT64
    if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
        raise BadRequest(field, f"{value} is outside [{low}, {high}]")
    return value


def parse_n(field: str, value: Any) -> int:
    """The number of samples per prompt: absent or null means 1, else an int >= 1."""
    n = 1 if value is None else _convert(field, value, int)
    if n < 1:
        raise BadRequest(field, f"{n} must be >= 1")
    return n


def check_neutral(key: str, value: Any, name: str) -> None:
    """A field the server knows but does not implement: only its neutral value passes."""
    neutral = NEUTRAL[key]
    if neutral != "any" and value is not None and value != neutral:
        raise BadRequest(name, f"{value!r} is not supported by the built-in server")


def parse_params(
    body: Mapping[str, Any], table: dict[str, tuple[str, Any]], extra: set[str], prefix: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `body` into SamplingSpec fields (by `table`) and `extra` ones; unknown keys -> 400."""
    if not isinstance(body, Mapping):
        raise BadRequest(prefix.rstrip(".") or "body", "must be a JSON object")
    fields: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for key, value in body.items():
        name = prefix + key
        if key in table:
            field, kind = table[key]
            if value is not None or kind in ("str_list", "int_list"):
                fields[field] = _convert(name, value, kind)
        elif key in extra:
            others[key] = value
        elif key in NEUTRAL:
            check_neutral(key, value, name)
        else:
            raise unknown_key(name, set(table) | extra | set(NEUTRAL))
    return fields, others


def sglang_spec(params: Any, top_logprobs: int) -> tuple[SamplingSpec, int]:
    """SamplingSpec and n from one SGLang `sampling_params` object."""
    fields, others = parse_params(params or {}, SGLANG_PARAMS, {"n"}, "sampling_params.")
    n = parse_n("sampling_params.n", others.get("n"))
    names = {k: f"sampling_params.{w}" for w, (k, _) in SGLANG_PARAMS.items()}
    spec = check_spec(SamplingSpec(**_defaults(fields, names), top_logprobs=top_logprobs), names)
    return spec, n


def openai_spec(body: Mapping[str, Any], extra: set[str]) -> tuple[SamplingSpec, int, dict]:
    """SamplingSpec, n and the remaining route fields of an OpenAI-style request body."""
    fields, others = parse_params(body, OPENAI_PARAMS, extra | {"n"})
    fields.setdefault("max_new_tokens", 16)
    fields.setdefault("no_stop_trim", False)
    n = parse_n("n", others.pop("n", None))
    names = {k: w for w, (k, _) in OPENAI_PARAMS.items() if w != "max_completion_tokens"}
    return check_spec(SamplingSpec(**_defaults(fields, names)), names), n, others


def _defaults(fields: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Tuples for the list fields; the two ranges SamplingSpec asserts are 400s here."""
    fields = dict(fields)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            fields[key] = tuple(fields[key])
    if "temperature" in fields:
        fields["temperature"] = float(fields["temperature"])
    for key in ("max_new_tokens", "temperature"):
        if fields.get(key, 0) < 0:
            raise BadRequest(names[key], f"{fields[key]} must be >= 0")
    return fields


def token_ids_or_none(field: str, value: Any) -> list[int] | list[list[int]] | None:
    """Validate a token-id prompt: a list of ints, or a list of such lists."""
    if not isinstance(value, list):
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if value and all(isinstance(p, list) for p in value):
        for i, p in enumerate(value):
            as_int_list(f"{field}[{i}]", p)
        return value
    return None
