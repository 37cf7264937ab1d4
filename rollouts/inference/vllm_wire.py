"""vLLM's OpenAI-compatible wire: the request bodies the client sends and the parsers of its
answers (`/v1/completions` with token ids, prompt logprobs, the weight-transfer routes' infos).

Pure functions, so a test pins every field name; `vllm.py` is the client that sends them. The
built-in server answers the same bodies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollouts.inference.http import EngineError, loads
from rollouts.inference.protocol import TensorSpecLike, WeightGroupSpec
from rollouts.inference.sglang_wire import TopLogprobs, shared_sampling_fields
from rollouts.inference.versions import span_versions
from rollouts.wire.generation import Completion, FinishReason, SamplingParams

FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}


def completion_body(
    input_ids: Sequence[int], sampling: SamplingParams, rid: str | None, model: str | None
) -> dict[str, Any]:
    """The POST /v1/completions body for one token-id prompt (vLLM field names)."""
    assert len(input_ids) > 0, "input_ids must not be empty"
    body: dict[str, Any] = {
        "prompt": list(input_ids),
        "max_tokens": sampling.max_new_tokens,
        **shared_sampling_fields(sampling),  # as the SGLang client: the same decoded text
        "include_stop_str_in_output": sampling.no_stop_trim,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
    }
    if model is not None:
        body["model"] = model
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if rid is not None:
        body["request_id"] = rid
    return body


def completion_request_id(rid: str, prompt_index: int = 0) -> str:
    """The id vLLM's /abort_requests knows a /v1/completions request by: its `request_id`
    prefixed `cmpl-` (the answer's `id`) and suffixed with the prompt's index."""
    return f"cmpl-{rid}-{prompt_index}"


def parse_completion(answer: Any, version: str) -> Completion:
    """A /v1/completions answer with one choice -> Completion served by weight `version`."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices:
        raise EngineError(f"/v1/completions answer has no choices: {str(answer)[:200]}")
    choice = choices[0]
    if choice.get("token_ids") is None:
        raise EngineError("/v1/completions answer has no token_ids (return_token_ids ignored?)")
    output_ids = tuple(int(t) for t in choice["token_ids"])
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(output_ids):
        raise EngineError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
    usage = answer.get("usage") or {}
    prompt_ids = choice.get("prompt_token_ids")
    prompt_tokens = len(prompt_ids) if prompt_ids is not None else usage.get("prompt_tokens", 0)
    return Completion(
        output_ids=output_ids,
        logprobs=tuple(float(x) for x in logprobs),
        finish_reason=FINISH.get(choice.get("finish_reason"), FinishReason.ERROR),
        weight_version=version,
        prompt_tokens=int(prompt_tokens),
        completion_tokens=len(output_ids),
        text=str(choice.get("text", "")),
        matched_stop=choice.get("stop_reason"),
    )


# a /v1/completions answer as read: its Completion (version "", until the client's bracket
# picks it), the versions of its spans, and whether the server reported them at all
ReadCompletion = tuple[Completion, list[str], bool]


def read_completion(content: bytes) -> ReadCompletion:
    """A /v1/completions answer's bytes -> its `ReadCompletion`. A module-level function: an
    engine client process runs it (`client_procs.py`)."""
    answer = loads(content)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else {}
    reports = isinstance(choice, dict) and "weight_versions" in choice
    spans = span_versions(choice.get("weight_versions")) if reports else []
    return parse_completion(answer, ""), spans, reports


def prompt_logprobs_body(
    input_ids: Sequence[int], model: str | None, top: int = 0
) -> dict[str, Any]:
    """POST /v1/completions asking for the prompt tokens' logprobs (one output token), and
    the `top` likeliest at each position."""
    assert len(input_ids) >= 2, "a prompt-logprobs probe needs two tokens"
    body: dict[str, Any] = {
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "seed": 0,
        "prompt_logprobs": top,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    return body


def parse_prompt_logprobs(
    answer: Any, input_ids: Sequence[int], start: int = 1
) -> tuple[float, ...]:
    """`choices[0].prompt_logprobs` (null, then {token id: {logprob, rank, ...}} per position)
    -> the logprob of each of `input_ids[start:]`."""
    assert 1 <= start < len(input_ids), f"{start=} for {len(input_ids)} tokens"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    entries = choices[0].get("prompt_logprobs") if choices else None
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise EngineError(f"/v1/completions gave no prompt_logprobs for the prompt: {entries!r}")
    out = []
    for t in range(start, len(input_ids)):
        entry = (entries[t] or {}).get(str(input_ids[t]))
        if not isinstance(entry, dict) or entry.get("logprob") is None:
            raise EngineError(f"prompt_logprobs[{t}] has no entry for token {input_ids[t]}")
        out.append(float(entry["logprob"]))
    return tuple(out)


def parse_prompt_top_logprobs(
    answer: Any, input_ids: Sequence[int], top: int, start: int = 1
) -> TopLogprobs:
    """The `top` likeliest (id, logprob) predicting each of `input_ids[start:]`: the entries of
    `choices[0].prompt_logprobs` ranked 1..top, in rank order."""
    entries = answer["choices"][0]["prompt_logprobs"]  # parse_prompt_logprobs checked the shape
    out = []
    for t in range(start, len(input_ids)):
        ranked = sorted(
            (int(e["rank"]), int(tok), float(e["logprob"]))
            for tok, e in entries[t].items()
            if e.get("rank") is not None and int(e["rank"]) <= top
        )
        if len(ranked) != top:
            raise EngineError(f"prompt_logprobs[{t}] has {len(ranked)} entries ranked 1..{top}")
        out.append(tuple((tok, lp) for _, tok, lp in ranked))
    return tuple(out)


def reports_weight_versions(version: str) -> bool | None:
    """Whether vLLM `version` answers `return_weight_versions` (0.33+); None if unparseable."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    return (major, minor) >= (0, 33)


def transfer_init_info(group: WeightGroupSpec, rank_offset: int) -> dict[str, Any]:
    """`init_info` of POST /init_weight_transfer_engine (NCCL backend, TCP rendezvous).

    Only the fields vLLM 0.27 to 0.33 all accept; no `packed`: tensors go one by one.
    """
    return {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": rank_offset,
        "world_size": group.world_size,
    }


def transfer_update_info(specs: Sequence[TensorSpecLike]) -> dict[str, Any]:
    """`update_info` of POST /update_weights (vLLM's NCCLWeightTransferUpdateInfo)."""
    assert specs, "an empty bucket"
    return {
        "names": [s.name for s in specs],
        "dtype_names": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
    }
