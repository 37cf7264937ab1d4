"""SGLang's wire format: the request bodies the client sends and the parsers of its answers.

Pure functions, so a test pins every field name; `sglang.py` is the client that sends them. The
built-in server (`rollouts serve`) reads the same bodies.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, TypeVar

from rollouts.inference.http import EngineError, loads
from rollouts.inference.protocol import TensorSpecLike, WeightGroupSpec
from rollouts.inference.versions import span_versions
from rollouts.wire.generation import Completion, FinishReason, GenerateRequest, SamplingParams

T = TypeVar("T")


def shared_sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The sampling fields SGLang and vLLM name alike, with slime's choices for the text options;
    the vLLM client sends them too, so both servers decode the same text."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for one request."""
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        **shared_sampling_fields(sampling),
        "no_stop_trim": sampling.no_stop_trim,
    }
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    return body


def generate_body(
    input_ids: Sequence[int],
    sampling: SamplingParams,
    rid: str | None,
    adapter: str | None = None,
) -> dict[str, Any]:
    """The POST /generate body: token ids in, logprobs of the output tokens back; `adapter`,
    the name of a loaded LoRA adapter, goes in `lora_path`."""
    assert len(input_ids) > 0, "input_ids must not be empty"
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_body(sampling),
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if rid is not None:
        body["rid"] = rid
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def batch_generate_body(
    requests: Sequence[GenerateRequest], adapter: str | None = None
) -> dict[str, Any]:
    """The POST /generate body of a batch: one entry per prompt in input_ids, sampling_params
    and rid (every request has a rid, or none has: SGLang takes a list of strings or nothing),
    and `lora_path` when an adapter is named."""
    assert requests, "an empty batch"
    rids = [r.rid for r in requests]
    assert all(rids) or not any(rids), f"some requests have a rid, some not: {rids}"
    body: dict[str, Any] = {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [sampling_body(r.sampling) for r in requests],
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if all(rids):
        body["rid"] = rids
    if adapter is not None:
        body["lora_path"] = [adapter] * len(requests)
    return body


def logprob_start_len(start: int) -> int:
    """`logprob_start_len` asking for the logprobs of `input_ids[start:]`: 0 for every token's
    (the first one's null), else `start` (the server scores only those positions)."""
    return 0 if start == 1 else start


def input_logprobs_body(
    input_ids: Sequence[int], adapter: str | None = None, top: int = 0, start: int = 1
) -> dict[str, Any]:
    """POST /generate asking for the logprobs of `input_ids[start:]` (`logprob_start_len`), and
    with `top` the `top` likeliest tokens at each of those positions (`top_logprobs_num`)."""
    assert len(input_ids) >= 2, "a prompt-logprobs probe needs two tokens"
    assert 1 <= start < len(input_ids), f"{start=} for {len(input_ids)} tokens"
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 0},  # score the prompt, generate nothing
        "return_logprob": True,
        "logprob_start_len": logprob_start_len(start),
    }
    if top:
        body["top_logprobs_num"] = top
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def _per_prompt_token(answer: Any, key: str, n: int) -> list[Any]:
    """meta_info[key]: a list with one entry per prompt token from `logprob_start_len` on
    (`n`), or EngineError."""
    entries = one_answer(answer)["meta_info"].get(key)
    if not isinstance(entries, list) or len(entries) != n:
        got = len(entries) if isinstance(entries, list) else entries
        raise EngineError(f"/generate gave {got!r} {key} for {n}")
    return entries


TopLogprobs = tuple[tuple[tuple[int, float], ...], ...]  # per position: (token id, logprob) x k


def parse_input_top_logprobs(
    answer: Any, input_ids: Sequence[int], top: int, start: int = 1
) -> TopLogprobs:
    """meta_info.input_top_logprobs (per prompt token from `logprob_start_len` on a list of
    `[logprob, token_id, text]`, position 0's empty) -> the `top` likeliest (id, logprob)
    predicting each of `input_ids[start:]`."""
    first = logprob_start_len(start)
    entries = _per_prompt_token(answer, "input_top_logprobs", len(input_ids) - first)
    out = []
    for t in range(start, len(input_ids)):
        step = entries[t - first]
        if not isinstance(step, list) or len(step) != top or any(e[0] is None for e in step):
            raise EngineError(f"input_top_logprobs[{t}] = {step!r}: not {top} (logprob, id)")
        out.append(tuple((int(e[1]), float(e[0])) for e in step))
    return tuple(out)


def parse_input_logprobs(
    answer: Any, input_ids: Sequence[int], start: int = 1
) -> tuple[float, ...]:
    """meta_info.input_token_logprobs (`[logprob, token_id, text]` per prompt token from
    `logprob_start_len` on, position 0's logprob null) -> the logprob of each of
    `input_ids[start:]`; each entry's token id must be the one at its position."""
    first = logprob_start_len(start)
    entries = _per_prompt_token(answer, "input_token_logprobs", len(input_ids) - first)
    out = []
    for t in range(start, len(input_ids)):
        entry = entries[t - first]
        lp, tok = entry[0], entry[1]
        if lp is None or int(tok) != int(input_ids[t]):
            raise EngineError(
                f"input_token_logprobs[{t - first}] = {entry!r}, not token {input_ids[t]}"
            )
        out.append(float(lp))
    return tuple(out)


def finish_reason(obj: Any) -> tuple[FinishReason, int | str | None]:
    """meta_info.finish_reason -> (FinishReason, matched)."""
    if not isinstance(obj, dict):
        return FinishReason.ERROR, None
    kind = obj.get("type")
    if kind == "stop":
        return FinishReason.STOP, obj.get("matched")
    if kind == "length":
        return FinishReason.LENGTH, None
    if kind == "abort":
        return FinishReason.ABORT, None
    return FinishReason.ERROR, None


def one_answer(answer: Any) -> dict[str, Any]:
    """The answer object of a one-prompt /generate (an EngineError if it has no meta_info)."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise EngineError(f"/generate answer has no meta_info: {str(answer)[:200]}")
    return answer


def _token_ids(values: Any) -> tuple[int, ...]:
    """Token ids as ints: JSON's integers as they are (their sum is an int only when every one
    is: a C loop, 5x cheaper than packing them into an array), anything else through `int`
    (a float id such as 5.0, as before)."""
    try:
        only_ints = type(sum(values)) is int
    except TypeError:  # not iterable, or an item that is no number
        only_ints = False
    return tuple(values) if only_ints else tuple(map(int, values))


def _columns(entries: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The logprob and token id columns of `[logprob, token_id, text]` entries."""
    if not entries:
        return (), ()
    columns = tuple(zip(*entries, strict=False))  # as many as the shortest entry has fields
    if len(columns) < 2:  # an entry with no token id: itemgetter raises what it did before
        return tuple(map(itemgetter(0), entries)), tuple(map(itemgetter(1), entries))
    return columns[0], columns[1]


def _logprobs_and_ids(entries: Sequence[Any]) -> tuple[tuple[float, ...], tuple[Any, ...]] | None:
    """The logprobs (as floats) and token ids of `[logprob, token_id, text]` entries in one pass
    each, or None where an entry or a logprob is not what JSON's lists of numbers give (then
    `_columns` reads them and raises what it did before)."""
    try:
        logprobs = tuple(map(float, map(itemgetter(0), entries)))
        ids = tuple(map(itemgetter(1), entries))
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    return logprobs, ids


FLAT_KEY = "rollouts_flat_token_logprobs"  # meta_info's entries as one flat list, see below
_NESTED = b'"output_token_logprobs":[['
_FLAT = b'"%s":[' % FLAT_KEY.encode()
_SCALARS = b"0123456789.eE+-,nul[]"  # what the entries' bytes may hold
_BRACKETS_TO_SPACES = bytes.maketrans(b"[]", b"  ")


def flatten_token_logprobs(content: bytes) -> bytes:
    """A /generate answer's bytes with each `"output_token_logprobs":[[lp,id,null],...]` written
    as `"rollouts_flat_token_logprobs":[N, lp,id,null , ...]` (N: the entries, one more than
    the opening brackets inside; those brackets as spaces), so the JSON decoder builds one list,
    not a list per token: decoding and freeing the answers is the driver's largest cost per
    sample. Only where the entries' bytes are numbers, nulls, commas and balanced brackets
    (SGLang's and the built-in server's compact JSON); any other answer comes back as it was.
    `parse_generate` takes the flat list only as N `[lp, id, null]` triples whose ids are
    output_ids, or `read_generate` reads the answer again as it was."""
    parts = content.split(_NESTED)
    if len(parts) == 1:
        return content
    out = [parts[0]]
    for part in parts[1:]:
        # the entries end before the next key's quote or meta_info's closing brace (one byte
        # searched, not the many "]]" an entry's own brackets would make a search try)
        ends = [i for i in (part.find(b'"'), part.find(b"}")) if i >= 0]
        if not ends:
            return content
        region = part[: min(ends)]
        inner = region[:-3] if region.endswith(b"]],") else region[:-2]
        if not inner or not region.startswith(b"]]", len(inner)):
            return content
        if inner.translate(None, _SCALARS):
            return content
        entries = inner.count(b"[") + 1
        if entries != inner.count(b"]") + 1:
            return content
        flat = inner.translate(_BRACKETS_TO_SPACES)
        out += (_FLAT, b"%d," % entries, flat, b"]", part[len(inner) + 2 :])
    return b"".join(out)


class _NotTriples(Exception):
    """A flat entry list that is not `[lp, id, null]` triples matching output_ids."""


def read_generate(content: bytes, read: Callable[[Any], T]) -> T:
    """`read` of a /generate answer's JSON, its token logprobs decoded flat (2x faster to decode
    and free); an answer whose flat entries are not what `parse_generate` reads fast is decoded
    again as it was, so every answer is read, or refused, exactly as before."""
    flat = flatten_token_logprobs(content)
    if flat is not content:
        try:
            return read(loads(flat))
        except (_NotTriples, json.JSONDecodeError):
            pass
    return read(loads(content))


def _flat_columns(
    flat: list[Any], output_ids: tuple[int, ...]
) -> tuple[tuple[float, ...], tuple[Any, ...]]:
    """The logprobs (as floats) and token ids of a flat `[lp, id, null, ...]` list of one
    triple per output id; `_NotTriples` for anything else."""
    n = len(output_ids)
    texts = flat[3::3]
    if flat[0] != n or len(flat) != 1 + 3 * n or texts.count(None) != n:
        raise _NotTriples
    try:
        logprobs = tuple(map(float, flat[1::3]))  # a null logprob raises TypeError
    except TypeError:
        raise _NotTriples from None
    ids = tuple(flat[2::3])
    if ids != output_ids:
        raise _NotTriples
    return logprobs, ids


def parse_generate(answer: Any, version: str | None = None) -> Completion:
    """One /generate answer -> Completion (checks ids and logprobs line up); `version`, when
    given, replaces meta_info.weight_version (the client's bracket, `versions.py`)."""
    answer = one_answer(answer)
    meta = answer["meta_info"]
    output_ids = _token_ids(answer.get("output_ids", ()))
    flat = meta.get(FLAT_KEY)
    if flat is not None:  # from `read_generate`
        logprobs, _ = _flat_columns(flat, output_ids)
    else:
        logprobs = _logprobs(meta.get("output_token_logprobs") or [], output_ids)
    reason, matched = finish_reason(meta.get("finish_reason"))
    return Completion(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=version or str(meta.get("weight_version", "default")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=len(output_ids),
        text=str(answer.get("text", "")),
        matched_stop=matched,
    )


# one prompt's answer as read: its Completion (version: the one the server reported, else
# "default"), the versions of its spans, and the version it reported (None: none)
ReadAnswer = tuple[Completion, list[str], str | None]


def read_answer(answer: Any) -> ReadAnswer:
    """One prompt's answer object -> its `ReadAnswer`; the client picks the version (its sync
    bracket, `versions.py`)."""
    answer = one_answer(answer)
    meta = answer["meta_info"]
    reported = meta.get("weight_version")
    spans = span_versions(meta.get("weight_versions"))
    return parse_generate(answer), spans, None if reported is None else str(reported)


def _read_batch(answers: Any, count: int | None) -> list[ReadAnswer]:
    if count is None:  # a one-prompt /generate
        return [read_answer(answers)]
    if not isinstance(answers, list) or len(answers) != count:
        got = len(answers) if isinstance(answers, list) else type(answers).__name__
        raise EngineError(f"batch /generate of {count} prompts answered {got}")
    return [read_answer(answer) for answer in answers]


def read_answers(content: bytes, count: int | None) -> list[ReadAnswer]:
    """A /generate answer's bytes -> a `ReadAnswer` per prompt: `count` of them from a batch
    (SGLang's list form), one from a one-prompt request (`count` None). A module-level function:
    an engine client process runs it (`client_procs.py`)."""
    return read_generate(content, functools.partial(_read_batch, count=count))


def _logprobs(entries: Any, output_ids: tuple[int, ...]) -> tuple[float, ...]:
    """The logprobs of `[logprob, token_id, text]` entries, checked against output_ids."""
    if len(entries) != len(output_ids):
        raise EngineError(f"{len(entries)} logprobs for {len(output_ids)} output tokens")
    # columns by C loops, no per-token Python code: this runs for every sample on the driver's
    # thread; an entry the fast path cannot read goes through `_columns`, as before
    fast = _logprobs_and_ids(entries)
    logprobs, ids = fast if fast is not None else _columns(entries)
    if ids != output_ids and tuple(map(int, ids)) != output_ids:
        raise EngineError("output_token_logprobs token ids differ from output_ids")
    return logprobs if fast is not None else tuple(map(float, logprobs))


def init_group_body(group: WeightGroupSpec, rank_offset: int) -> dict[str, Any]:
    """The POST /init_weights_update_group body (SGLang's InitWeightsUpdateGroupReqInput)."""
    return {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }


def distributed_update_body(
    specs: Sequence[TensorSpecLike], *, group_name: str, version: str | None, flush_cache: bool
) -> dict[str, Any]:
    """The POST /update_weights_from_distributed body for one bucket, sent tensor by tensor."""
    assert specs, "an empty bucket"
    return {
        "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": version,
        "load_format": None,  # tensor by tensor
    }
