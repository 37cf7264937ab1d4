"""SGLang-native routes: /generate, weight updates, pause/continue, abort, info, loads."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollouts.engine.core import Sequence
from rollouts.engine.http_util import json_body, state_of, unless_disconnected
from rollouts.engine.sampling import BadRequest, as_type
from rollouts.engine.scheduler import trim_text
from rollouts.engine.state import ServerState, WeightPathForbidden
from rollouts.engine.wire import check_generate_keys, sglang_spec, token_ids_or_none
from rollouts.heap import heap_mode
from rollouts.wire.generation import FinishReason

PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
CLIENT_GONE = 499  # the status logged for a request whose client disconnected (nginx's code)


def finish_json(seq: Sequence) -> dict[str, Any]:
    """SGLang's meta_info.finish_reason object."""
    assert seq.stop is not None, f"{seq.rid} has not finished"
    reason = seq.stop.reason
    if reason is FinishReason.STOP:
        return {"type": "stop", "matched": seq.stop.matched}
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(seq.output_ids)}
    if reason is FinishReason.ABORT:
        return {"type": "abort", "message": "Aborted"}
    return {"type": "error", "message": "the engine failed during generation; see its log"}


def output_text(state: ServerState, seq: Sequence) -> str:
    """Decoded output, cut at a matched stop string unless the request keeps it."""
    text = state.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.spec.skip_special_tokens)
    assert seq.stop is not None, f"{seq.rid} has not finished"
    return trim_text(text, seq.spec.stop, seq.stop.matched, keep=seq.spec.no_stop_trim)


def sglang_result(state: ServerState, seq: Sequence, opts: dict[str, Any]) -> dict[str, Any]:
    """One /generate answer object (text, output_ids, meta_info)."""
    with_text = bool(opts.get("return_text_in_logprobs"))

    def entry(lp: float, tok: int) -> list[Any]:
        return [lp, tok, state.tokenizer.decode([tok]) if with_text else None]

    meta: dict[str, Any] = {
        "id": seq.rid,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": seq.weight_version,
        "finish_reason": finish_json(seq),
        "e2e_latency": round(time.monotonic() - seq.created_s, 6),
    }
    spans = seq.version_spans()
    if len(spans) > 1:  # as SGLang: only when the weights changed during the request
        meta["weight_versions"] = spans
    if opts.get("return_logprob"):
        meta["output_token_logprobs"] = [
            entry(lp, t) for lp, t in zip(seq.logprobs, seq.output_ids, strict=True)
        ]
        if seq.spec.top_logprobs:
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in step] for step in seq.top]
    out: dict[str, Any] = {"text": output_text(state, seq), "output_ids": seq.output_ids}
    if opts.get("return_prompt_token_ids"):
        out["prompt_token_ids"] = seq.prompt_ids
    out["meta_info"] = meta
    return out


async def input_logprobs(
    state: ServerState, prompt: list[int], body: dict[str, Any], top_n: int
) -> dict[str, Any]:
    """`input_token_logprobs` (and `input_top_logprobs`) from `logprob_start_len` on, as
    SGLang: `[logprob, token_id, text]` per prompt token, the first token's logprob null."""
    start = body.get("logprob_start_len", -1)
    if start is None or start == -1 or not body.get("return_logprob"):
        return {}
    start = as_type("logprob_start_len", start, int)
    if not 0 <= start < len(prompt):
        raise BadRequest(
            "logprob_start_len", f"{start} must be -1 or in [0, {len(prompt)}) for this prompt"
        )
    with_text = bool(body.get("return_text_in_logprobs"))

    def entry(lp: float | None, tok: int) -> list[Any]:
        return [lp, tok, state.tokenizer.decode([tok]) if with_text else None]

    # only the positions asked for are scored (a teacher asks for a response's tokens alone)
    positions = await state.prompt_logprobs(prompt, top_n, max(start, 1))
    first = [entry(None, prompt[0])] if start == 0 else []
    out: dict[str, Any] = {
        "input_token_logprobs": first + [entry(p.logprob, p.token) for p in positions]
    }
    if top_n:
        tops = [[]] if start == 0 else []
        out["input_top_logprobs"] = tops + [[entry(lp, t) for lp, t in p.top] for p in positions]
    return out


async def sglang_prompts(state: ServerState, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts as token ids (texts encoded off the event loop), and whether it was a batch."""
    if body.get("text") is not None:
        text = body["text"]
        if isinstance(text, str):
            return [await state.encode(text, "text")], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [await state.encode(t, f"text[{i}]") for i, t in enumerate(text)], True
        raise BadRequest("text", "must be a string or a non-empty list of strings")
    if body.get("input_ids") is not None:
        ids = token_ids_or_none("input_ids", body["input_ids"])
        if ids is None or not ids:
            raise BadRequest("input_ids", "must be a non-empty list of token ids or of such lists")
        if isinstance(ids[0], list):
            return [list(p) for p in ids], True
        return [list(ids)], False
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds", "not supported by the built-in server")
    raise BadRequest("text", "give exactly one of text or input_ids")


def _per_prompt(field: str, value: Any, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(field, f"has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


async def generate(request: Request) -> Response:
    """POST /generate: one prompt or a batch; n samples each; aborts answer 200 with partials."""
    state = state_of(request)
    body = await json_body(request)
    check_generate_keys(body)
    if body.get("stream"):
        raise BadRequest("stream", "streaming is not supported by the built-in server")
    prompts, is_batch = await sglang_prompts(state, body)
    for i, p in enumerate(prompts):
        state.check_prompt(p, "input_ids" if body.get("text") is None else f"text[{i}]")
    top_n = as_type("top_logprobs_num", body.get("top_logprobs_num") or 0, int)
    params = _per_prompt("sampling_params", body.get("sampling_params") or {}, len(prompts))
    rids = _per_prompt("rid", body.get("rid"), len(prompts))
    for i, adapter in enumerate(_per_prompt("lora_path", body.get("lora_path"), len(prompts))):
        state.check_adapter(adapter, f"lora_path[{i}]" if is_batch else "lora_path")
    work = []
    for p, sp, rid in zip(prompts, params, rids, strict=True):
        spec, n = sglang_spec(sp, top_n)
        work.append((p, spec, str(rid) if rid is not None else state.new_rid(), n))
    state.check_count(sum(n for *_, n in work), "sampling_params.n")
    groups = await unless_disconnected(request, lambda: state.generate_many(work))
    if groups is None:
        return Response(status_code=CLIENT_GONE)
    results = []
    for prompt, group in zip(prompts, groups, strict=True):
        extra = await input_logprobs(state, prompt, body, top_n)
        for seq in group:
            result = sglang_result(state, seq, body)
            result["meta_info"] |= extra
            results.append(result)
    if not is_batch and len(results) == 1:
        return JSONResponse(results[0])
    return JSONResponse(results)


async def update_weights_from_disk(request: Request) -> Response:
    """POST /update_weights_from_disk: reload HF safetensors; 400 with success false on failure.

    Like SGLang 0.5.22+, `flush_cache` (default true) is refused while an in_place pause holds
    running requests (SGLang cannot flush their KV cache; 0.5.21 crashed): pause with retract.
    """
    state = state_of(request)
    body = await json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path", "must be the path of an HF-format checkpoint directory")
    version = body.get("weight_version")
    version = None if version is None else str(version)
    running, _ = state.core.load()
    if body.get("flush_cache", True) and state.sglang_pause == "in_place" and running:
        message = (
            f"Cache not flushed: {running} running requests under an in_place pause "
            "(pause with mode retract to flush)"
        )
        return JSONResponse(
            {"success": False, "message": message, "num_paused_requests": 0}, status_code=400
        )
    try:
        await state.reload(path, version, bool(body.get("abort_all_requests")))
    except WeightPathForbidden as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=403)
    except ValueError as exc:
        return JSONResponse(
            {"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400
        )
    message = f"Succeeded to update model weights from {path}."
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


async def update_weight_version(request: Request) -> Response:
    """POST /update_weight_version {"new_version": "13"}: as SGLang and vLLM (>= 0.27) take it.

    `abort_all_requests` (SGLang's field) is honoured when true; its default here is vLLM's
    behaviour (nothing aborted), since the vLLM client is the one that calls this route.
    """
    state = state_of(request)
    body = await json_body(request)
    version = body.get("new_version")
    if not isinstance(version, str):
        raise BadRequest("new_version", f"{version!r}: must be the new version as a string")
    if body.get("abort_all_requests"):
        await state.abort(None)
    await state.set_version(version)
    message = f"Weight version updated to {version}"
    return JSONResponse({"success": True, "message": message, "new_version": version})


async def pause_generation(request: Request) -> Response:
    """POST /pause_generation {"mode": "abort"|"retract"|"in_place"}: new requests wait."""
    state = state_of(request)
    body = await json_body(request, allow_empty=True)
    mode = body.get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise BadRequest("mode", f"{mode!r} must be one of {list(PAUSE_MODES)}")
    await state.pause(PAUSE_MODES[mode], reject_new=False)
    state.sglang_pause = mode
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    """POST /continue_generation: resume after a pause."""
    await state_of(request).resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: Request) -> Response:
    """POST /abort_request {"rid": ...} or {"abort_all": true}: empty 200."""
    state = state_of(request)
    body = await json_body(request, allow_empty=True)
    if body.get("abort_all"):
        await state.abort(None)
    elif isinstance(body.get("rid"), str) and body["rid"]:
        await state.abort(body["rid"])
    else:
        raise BadRequest("rid", "give a request id, or abort_all: true")
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    """/flush_cache: 200 when idle (no prefix cache to flush), 400 while requests run."""
    if not state_of(request).core.idle():
        return Response("Cache not flushed: requests are running", status_code=400)
    return Response("Cache flushed.", status_code=200)


async def model_info(request: Request) -> Response:
    """GET /model_info (and the deprecated /get_model_info), with SGLang 0.5.23's fields."""
    state = state_of(request)
    hf_config = getattr(state.core.model, "config", None)
    return JSONResponse(
        {
            "model_path": state.info.model_path,
            "served_model_name": state.info.served_model_name,
            "tokenizer_path": state.info.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.core.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(hf_config, "model_type", None),
            "architectures": getattr(hf_config, "architectures", None),
        }
    )


async def server_info(request: Request) -> Response:
    """GET /server_info: the server's settings."""
    info = state_of(request).info
    return JSONResponse(
        {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "context_length": info.context_len,
            "max_running_requests": info.max_batch,
            "max_queued_requests": info.max_queue,
            "logprobs_from": info.logprobs_from,
            "malloc": heap_mode(),  # "keep": freed memory reused (rollouts/heap.py)
            "engine": "rollouts",
            "version": "rollouts-builtin",
        }
    )


async def loads(request: Request) -> Response:
    """GET /v1/loads: running and waiting request counts."""
    running, waiting = state_of(request).core.load()
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting}
    return JSONResponse({"loads": [load], **load})


ROUTES = [
    Route("/generate", generate, methods=["POST"]),
    Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
    Route("/update_weight_version", update_weight_version, methods=["POST"]),
    Route("/pause_generation", pause_generation, methods=["POST"]),
    Route("/continue_generation", continue_generation, methods=["POST"]),
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    Route("/model_info", model_info, methods=["GET"]),
    Route("/get_model_info", model_info, methods=["GET"]),
    Route("/server_info", server_info, methods=["GET"]),
    Route("/get_server_info", server_info, methods=["GET"]),
    Route("/v1/loads", loads, methods=["GET"]),
]
