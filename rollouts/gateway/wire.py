"""The OpenAI chat-completions wire of the gateway, as pure functions.

`parse_request` reads a `/v1/chat/completions` body into a `ChatRequest`, refusing (a
`GatewayError`, an OpenAI-style 400 naming the field) what the gateway cannot record exactly:
`stream`, `n > 1`, a forced tool choice, sampling parameters other than the run's, fields it does
not know. `assistant_message` splits the model's text into `content` and `tool_calls`;
`completion_body` writes the answer the `openai` SDK parses (`ChatCompletion`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.envs.tool_format import ToolSpec, split_tool_calls
from rollouts.wire.generation import FinishReason, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields read from a request; anything else is refused by name
# fmt: off
KNOWN_FIELDS = frozenset((
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
    "logprobs", "top_logprobs", "stop", "temperature", "top_p", "n", "stream", "stream_options",
    "parallel_tool_calls", "seed", "user", "metadata", "store", "frequency_penalty",
    "presence_penalty", "logit_bias", "response_format",
))
# fmt: on


class GatewayError(Exception):
    """A refused call: the HTTP status, and an OpenAI-style error naming the field and the fix."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "") -> None:
        assert 400 <= status < 600, f"{status=} is not an error status"
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body of the error (what the SDK reads into `APIStatusError.body`)."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    """One chat-completions request, as far as the gateway reads it."""

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[ToolSpec, ...]
    tool_choice: str  # "auto" | "none"
    max_tokens: int | None
    logprobs: bool
    stop: tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.messages, "a request has at least one message"
        assert self.tool_choice in ("auto", "none"), f"{self.tool_choice=}"


def _refuse(field: str, why: str) -> GatewayError:
    return GatewayError(400, f"{field}: {why}", param=field)


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _refuse(f"{where}.content[{i}]", f"a {kind!r} part: only text parts")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise _refuse(f"{where}.content", f"must be a string or a list of text parts, not {content!r}")


def _tool_calls_of(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _refuse(f"{where}.tool_calls", "must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise _refuse(f"{where}.tool_calls[{i}]", "needs function.name and .arguments")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args)
        call_id = str(call.get("id") or f"call_{i}")
        out.append(
            {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def normalize_message(message: Any, where: str) -> dict[str, Any]:
    """A request message as the gateway keeps it: role, text content, tool calls, tool call id."""
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, Mapping) else message
        raise _refuse(f"{where}.role", f"{role!r} is not one of {list(ROLES)}")
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls_of(message["tool_calls"], where)
    elif out["content"] is None:
        raise _refuse(f"{where}.content", f"a {role} message needs content")
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _arguments(call: Mapping[str, Any]) -> Any:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def same_message(sent: Mapping[str, Any], kept: Mapping[str, Any]) -> bool:
    """Whether the agent's copy `sent` says what the gateway's record `kept` says: role, content
    (stripped; null = ""), tool calls' names and arguments (parsed). SDKs re-serialise them."""
    if sent["role"] != kept["role"]:
        return False
    if (sent.get("content") or "").strip() != (kept.get("content") or "").strip():
        return False
    calls = [
        [(c["function"]["name"], _arguments(c)) for c in m.get("tool_calls", ())]
        for m in (sent, kept)
    ]
    return calls[0] == calls[1]


def _check_sampling(body: Mapping[str, Any], run: SamplingParams) -> None:
    """Fields that would change the distribution the trainer assumes must be the run's."""
    fixed = {"temperature": run.temperature, "top_p": run.top_p}
    for field, value in fixed.items():
        got = body.get(field)
        if got is not None and not isinstance(got, (int, float)):
            raise _refuse(field, f"{got!r}: must be a number")
        if got is not None and float(got) != value:
            raise _refuse(
                field,
                f"{got} differs from the run's rollout.sampling.{field} = {value}; the trainer "
                f"assumes the run's sampling: leave {field} out (or send {value})",
            )
    for field in ("frequency_penalty", "presence_penalty"):
        if body.get(field) not in (None, 0, 0.0):
            raise _refuse(field, "penalties change the sampled distribution: leave it out")
    if body.get("logit_bias"):
        raise _refuse("logit_bias", "changes the sampled distribution: leave it out")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise _refuse("response_format", "constrained output is not supported: leave it out")


def _check_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _refuse(
            unknown[0], f"unknown or unsupported field; the gateway reads {sorted(KNOWN_FIELDS)}"
        )
    if body.get("stream"):
        raise _refuse("stream", "streaming is not supported: send stream=false (the default)")
    if body.get("stream_options") is not None:
        raise _refuse("stream_options", "streaming is not supported: leave it out")
    if body.get("n") not in (None, 1):
        raise _refuse(
            "n", f"{body.get('n')}: one choice per call (each sample is one sequence); send n=1"
        )
    if body.get("top_logprobs") not in (None, 0):
        raise _refuse("top_logprobs", "only the sampled token's logprob is recorded: leave it out")
    if body.get("parallel_tool_calls") is False:
        raise _refuse("parallel_tool_calls", "false cannot be enforced on the model's text")


def _tool_choice(value: Any) -> str:
    if value in (None, "auto", "none"):
        return value or "auto"
    raise _refuse(
        "tool_choice",
        f"{value!r}: forcing a call needs constrained decoding, which would change the sampled "
        'tokens; send "auto" (or "none")',
    )


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise _refuse(field, f"{value!r}: must be an integer >= 1")
            return value
    return None


def parse_request(body: Any, run: SamplingParams) -> ChatRequest:
    """Read and check a chat-completions body (see the module docstring)."""
    if not isinstance(body, Mapping):
        raise GatewayError(400, "the request body must be a JSON object")
    _check_unsupported(body)
    _check_sampling(body, run)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse("messages", "must be a non-empty list")
    tools_in = body.get("tools") or []
    try:
        tools = tuple(ToolSpec.from_openai(t) for t in tools_in)
    except (ValueError, AssertionError, AttributeError) as e:
        raise _refuse("tools", f"{e}") from e
    stop = body.get("stop") or ()
    return ChatRequest(
        model=str(body.get("model", "")),
        messages=tuple(normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice")),
        max_tokens=_max_tokens(body),
        logprobs=bool(body.get("logprobs")),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
    )


def assistant_message(text: str, split_calls: bool) -> dict[str, Any]:
    """The model's turn as an OpenAI assistant message: text before the first call as
    `content` (null when empty) and the calls as `tool_calls`; a malformed call, or no call,
    leaves the whole text as content."""
    content, calls = split_tool_calls(text) if split_calls else (text, [])
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text}
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


def finish_reason(message: Mapping[str, Any], reason: FinishReason) -> str:
    """OpenAI's finish_reason: "tool_calls" when the turn calls tools, else stop / length."""
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if reason is FinishReason.LENGTH else "stop"


def completion_body(
    *,
    model: str,
    message: Mapping[str, Any],
    finish: str,
    prompt_tokens: int,
    completion_tokens: int,
    token_logprobs: Sequence[tuple[str, float]] | None,
) -> dict[str, Any]:
    """A `chat.completion` object with one choice, `usage`, and the sampled tokens' logprobs
    when asked (`token_logprobs`: (token text, logprob) per sampled token)."""
    logprobs = None
    if token_logprobs is not None:
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in token_logprobs
        ]
        logprobs = {"content": content, "refusal": None}
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    choice = {"index": 0, "message": dict(message), "finish_reason": finish, "logprobs": logprobs}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
