"""OpenAI-compatible routes as vLLM answers them, with vLLM's dev-mode control routes."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollouts.engine.core import Sequence
from rollouts.engine.http_util import json_body, state_of, unless_disconnected
from rollouts.engine.sampling import BadRequest, as_type
from rollouts.engine.sglang_routes import CLIENT_GONE, output_text
from rollouts.engine.state import ServerState
from rollouts.engine.wire import openai_spec, token_ids_or_none
from rollouts.wire.generation import FinishReason

COMPLETION_EXTRA = {
    "prompt",
    "logprobs",
    "prompt_logprobs",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "return_weight_versions",
    "request_id",
}
CHAT_EXTRA = {
    "messages",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "return_weight_versions",
    "request_id",
    "add_generation_prompt",
    "continue_final_message",
}


def finish_fields(seq: Sequence) -> tuple[str, int | str | None]:
    """vLLM's finish_reason and stop_reason (the matched stop string or id; null for EOS)."""
    assert seq.stop is not None, f"{seq.rid} has not finished"
    reason = seq.stop.reason
    if reason is FinishReason.STOP:
        matched = seq.stop.matched
        explicit = isinstance(matched, str) or matched in seq.spec.stop_token_ids
        return "stop", matched if explicit else None
    return reason.value, None


def usage(groups: list[list[Sequence]]) -> dict[str, int]:
    prompt = sum(len(g[0].prompt_ids) for g in groups)
    completion = sum(len(s.output_ids) for g in groups for s in g)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """`prompt` as str | list[str] | list[int] | list[list[int]] -> token-id prompts."""
    if isinstance(prompt, str):
        return [await state.encode(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [await state.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    ids = token_ids_or_none("prompt", prompt)
    if ids is None or not ids:
        raise BadRequest("prompt", "must be a string, a list of strings, or token ids")
    return [list(p) for p in ids] if isinstance(ids[0], list) else [list(ids)]


def completion_choice(state: ServerState, seq: Sequence, index: int, body: dict) -> dict:
    """One choice of a /v1/completions answer."""
    finish, stop_reason = finish_fields(seq)
    choice: dict[str, Any] = {"index": index, "text": output_text(state, seq)}
    if body.get("logprobs") is not None:
        as_id = bool(body.get("return_tokens_as_token_ids"))
        name = (lambda t: f"token_id:{t}") if as_id else (lambda t: state.tokenizer.decode([t]))
        choice["logprobs"] = {
            "tokens": [name(t) for t in seq.output_ids],
            "token_logprobs": list(seq.logprobs),
            "top_logprobs": _top_logprobs(seq, name),
            "text_offset": _offsets(state, seq.output_ids),
        }
    else:
        choice["logprobs"] = None
    choice["finish_reason"], choice["stop_reason"] = finish, stop_reason
    if body.get("return_token_ids"):
        choice["token_ids"] = list(seq.output_ids)
        choice["prompt_token_ids"] = list(seq.prompt_ids)
    if body.get("return_weight_versions"):
        choice["weight_versions"] = seq.version_spans()
    return choice


def _top_logprobs(seq: Sequence, name: Any) -> list[dict[str, float]]:
    """vLLM's per-token dict: the sampled token first, then the top `logprobs` candidates."""
    tops = seq.top or [[] for _ in seq.output_ids]
    out = []
    for lp, tok, top in zip(seq.logprobs, seq.output_ids, tops, strict=True):
        step = {name(tok): lp}
        for top_lp, top_tok in top:
            step.setdefault(name(top_tok), top_lp)
        out.append(step)
    return out


def _offsets(state: ServerState, ids: list[int]) -> list[int]:
    out, pos = [], 0
    for t in ids:
        out.append(pos)
        pos += len(state.tokenizer.decode([t]))
    return out


async def completions(request: Request) -> Response:
    """POST /v1/completions (prompt as text or token ids; n; logprobs; return_token_ids)."""
    state = state_of(request)
    body = await json_body(request)
    spec, n, extra = openai_spec(body, COMPLETION_EXTRA)
    if "prompt" not in extra:
        raise BadRequest("prompt", "is required")
    top_n = as_type("logprobs", body.get("logprobs") or 0, int)
    if top_n:
        spec = _with_top(spec, top_n, "logprobs")
    prompts = await completion_prompts(state, extra["prompt"])
    for p in prompts:
        state.check_prompt(p, "prompt")
    rid = f"cmpl-{body.get('request_id') or uuid.uuid4().hex}"  # as vLLM: the answer's id,
    work = [(p, spec, f"{rid}-{i}", n) for i, p in enumerate(prompts)]  # prompt i's: `{id}-i`
    state.check_count(len(prompts) * n, "n")
    groups = await unless_disconnected(request, lambda: state.generate_many(work))
    if groups is None:
        return Response(status_code=CLIENT_GONE)
    choices = []
    for prompt, group in zip(prompts, groups, strict=True):
        of_prompt = await prompt_logprobs_field(state, prompt, body)
        for seq in group:
            choice = completion_choice(state, seq, len(choices), body)
            choices.append(choice | {"prompt_logprobs": of_prompt})
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or state.info.served_model_name,
            "choices": choices,
            "usage": usage(groups),
        }
    )


async def prompt_logprobs_field(
    state: ServerState, prompt: list[int], body: dict
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a dict keyed by token
    id of {logprob, rank, decoded_token}: the prompt's token and the top `prompt_logprobs`."""
    top = body.get("prompt_logprobs")
    if top is None:
        return None
    top = as_type("prompt_logprobs", top, int)
    if not 0 <= top <= 20:
        raise BadRequest("prompt_logprobs", f"{top} must be in [0, 20]")

    def entry(lp: float, rank: int, tok: int) -> dict[str, Any]:
        return {"logprob": lp, "rank": rank, "decoded_token": state.tokenizer.decode([tok])}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for p in await state.prompt_logprobs(prompt, top):
        step = {str(p.token): entry(p.logprob, p.rank, p.token)}
        for rank, (lp, tok) in enumerate(p.top, start=1):
            step.setdefault(str(tok), entry(lp, rank, tok))
        out.append(step)
    return out


def _with_top(spec: Any, top_n: int, field: str) -> Any:
    import dataclasses

    if not 0 <= top_n <= 20:
        raise BadRequest(field, f"{top_n} must be in [0, 20]")
    return dataclasses.replace(spec, top_logprobs=top_n)


def chat_choice(state: ServerState, seq: Sequence, index: int, body: dict) -> dict:
    """One choice of a /v1/chat/completions answer."""
    finish, stop_reason = finish_fields(seq)
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": output_text(state, seq)},
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if body.get("logprobs"):
        tops = seq.top or [[] for _ in seq.output_ids]
        choice["logprobs"] = {
            "content": [
                _chat_lp(state, lp, t, top)
                for lp, t, top in zip(seq.logprobs, seq.output_ids, tops, strict=True)
            ]
        }
    if body.get("return_token_ids"):
        choice["token_ids"] = list(seq.output_ids)
    if body.get("return_weight_versions"):
        choice["weight_versions"] = seq.version_spans()
    return choice


def _chat_lp(state: ServerState, lp: float, tok: int, top: list) -> dict[str, Any]:
    text = state.tokenizer.decode([tok])
    return {
        "token": text,
        "logprob": lp,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {
                "token": state.tokenizer.decode([t]),
                "logprob": v,
                "bytes": list(state.tokenizer.decode([t]).encode()),
            }
            for v, t in top
        ],
    }


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions: messages through the chat template, then as completions."""
    state = state_of(request)
    body = await json_body(request)
    spec, n, extra = openai_spec(body, CHAT_EXTRA)
    messages = extra.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
    if body.get("logprobs"):
        spec = _with_top(
            spec, as_type("top_logprobs", body.get("top_logprobs") or 0, int), "top_logprobs"
        )
    render = functools.partial(
        state.tokenizer.apply_chat_template,
        messages,
        tokenize=False,
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        continue_final_message=bool(body.get("continue_final_message", False)),
    )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs", "must be an object")
    try:  # in a thread: a long conversation must not stop the event loop
        text = await trio.to_thread.run_sync(functools.partial(render, **kwargs))
    except Exception as exc:  # a template error is the request's fault
        raise BadRequest("messages", f"the chat template failed: {exc}") from None
    prompt = await state.encode(text, "messages")
    state.check_prompt(prompt, "messages")
    rid = f"chatcmpl-{body.get('request_id') or uuid.uuid4().hex}"  # vLLM's id (and abort's)
    state.check_count(n, "n")
    groups = await unless_disconnected(
        request, lambda: state.generate_many([(prompt, spec, rid, n)])
    )
    if groups is None:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or state.info.served_model_name,
            "choices": [chat_choice(state, s, i, body) for i, s in enumerate(groups[0])],
            "usage": usage(groups),
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        }
    )


async def models(request: Request) -> Response:
    """GET /v1/models with max_model_len; a card per loaded LoRA adapter (its parent: the base)."""
    state = state_of(request)
    info = state.info
    card = {
        "id": info.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "rollouts",
        "root": info.model_path,
        "parent": None,
        "max_model_len": info.context_len,
    }
    adapters = [
        card | {"id": name, "root": path, "parent": info.served_model_name}
        for name, path in state.core.adapters.loaded.items()
    ]
    return JSONResponse({"object": "list", "data": [card, *adapters]})


async def collective_rpc(request: Request) -> Response:
    """POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}."""
    state = state_of(request)
    body = await json_body(request)
    if body.get("method") != "reload_weights":
        raise BadRequest("method", f"{body.get('method')!r}: only 'reload_weights' is supported")
    kwargs = body.get("kwargs") or {}
    path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
    if not isinstance(path, str) or not path:
        raise BadRequest("kwargs.weights_path", "must be the path of an HF checkpoint directory")
    await state.reload(path, None, abort_first=False)
    return JSONResponse({"results": [None]})


async def pause(request: Request) -> Response:
    """POST /pause?mode=abort|wait|keep: abort/wait -> new requests 503 until /resume."""
    mode = request.query_params.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise BadRequest("mode", f"{mode!r} must be one of ['abort', 'wait', 'keep']")
    await state_of(request).pause(mode, reject_new=True)
    return JSONResponse({"status": "paused"})


async def resume(request: Request) -> Response:
    """POST /resume."""
    await state_of(request).resume()
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request) -> Response:
    return JSONResponse({"is_paused": state_of(request).core.paused})


async def abort_requests(request: Request) -> Response:
    """POST /abort_requests {"request_ids": [...]} (empty = all)."""
    state = state_of(request)
    body = await json_body(request, allow_empty=True)
    ids = body.get("request_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadRequest("request_ids", "must be a list of request id strings")
    count = await state.abort(None) if not ids else await state.abort_requests(set(ids))
    return JSONResponse({"status": "aborted", "aborted": count})


async def weight_info(request: Request) -> Response:
    return JSONResponse({"weight_version": state_of(request).core.weight_version})


async def version(_request: Request) -> Response:
    return JSONResponse({"version": "rollouts-builtin"})


ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/collective_rpc", collective_rpc, methods=["POST"]),
    Route("/pause", pause, methods=["POST"]),
    Route("/resume", resume, methods=["POST"]),
    Route("/is_paused", is_paused, methods=["GET"]),
    Route("/abort_requests", abort_requests, methods=["POST"]),
    Route("/weight_info", weight_info, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
]
