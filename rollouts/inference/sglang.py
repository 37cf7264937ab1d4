"""SGLangEngine: the InferenceEngine Protocol over SGLang's native HTTP routes.

Works against SGLang itself and against the built-in server (`rollouts serve`), which answers
the same routes. Request bodies are built by pure functions so a test pins their field names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

from rollouts.inference.http import EngineError, EngineHttp, HttpOptions
from rollouts.inference.protocol import (
    PAUSE_MODES,
    Completion,
    EngineLoad,
    FinishReason,
    SamplingParams,
)

HEALTH_TIMEOUT_S = 5.0
WAIT_POLL_S = 0.05
# our pause modes -> SGLang's /pause_generation modes ("wait" has none: drain, then in_place)
SGLANG_PAUSE = {"abort": "abort", "wait": "in_place", "keep": "in_place"}


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for one request (slime's choices for the text options)."""
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "no_stop_trim": sampling.no_stop_trim,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    return body


def generate_body(
    input_ids: Sequence[int], sampling: SamplingParams, rid: str | None
) -> dict[str, Any]:
    """The POST /generate body: token ids in, logprobs of the output tokens back."""
    assert len(input_ids) > 0, "input_ids must not be empty"
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_body(sampling),
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if rid is not None:
        body["rid"] = rid
    return body


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


def parse_generate(answer: Any) -> Completion:
    """One /generate answer object -> Completion (checks ids and logprobs line up)."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, dict) or "meta_info" not in answer:
        raise EngineError(f"/generate answer has no meta_info: {str(answer)[:200]}")
    meta = answer["meta_info"]
    output_ids = tuple(int(t) for t in answer.get("output_ids", ()))
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(output_ids):
        raise EngineError(f"{len(entries)} logprobs for {len(output_ids)} output tokens")
    if any(int(e[1]) != t for e, t in zip(entries, output_ids, strict=True)):
        raise EngineError("output_token_logprobs token ids differ from output_ids")
    reason, matched = finish_reason(meta.get("finish_reason"))
    return Completion(
        output_ids=output_ids,
        logprobs=tuple(float(e[0]) for e in entries),
        finish_reason=reason,
        weight_version=str(meta.get("weight_version", "default")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=len(output_ids),
        text=str(answer.get("text", "")),
        matched_stop=matched,
    )


class SGLangEngine:
    """InferenceEngine over SGLang's native API (`/generate`, `/update_weights_from_disk`, ...)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str = "",
        options: HttpOptions | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.http = EngineHttp(url, api_key=api_key, options=options, transport=transport)
        self.url = self.http.url

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """POST /generate with input_ids; an abort answers 200 with the partial output."""
        answer = await self.http.json(
            "POST", "/generate", json_body=generate_body(input_ids, sampling, rid)
        )
        return parse_generate(answer)

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """POST /update_weights_from_disk; raises with the server's message on failure."""
        body = {
            "model_path": str(path),
            "load_format": None,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(version),
        }
        answer = await self.http.json("POST", "/update_weights_from_disk", json_body=body)
        if not answer.get("success", False):
            raise EngineError(f"{self.url}: weight update failed: {answer.get('message')}")

    async def pause(self, mode: str = "abort") -> None:
        """POST /pause_generation: abort -> abort, keep -> in_place; wait polls /v1/loads until
        nothing runs (bounded by the client timeout), then pauses in_place."""
        assert mode in PAUSE_MODES, f"{mode=} not in {PAUSE_MODES}"
        if mode == "wait":
            with trio.fail_after(self.http.options.timeout_s):
                while (await self.load()).total > 0:
                    await trio.sleep(WAIT_POLL_S)
        await self.http.call("POST", "/pause_generation", json_body={"mode": SGLANG_PAUSE[mode]})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self.http.call("POST", "/continue_generation", json_body={})

    async def abort_all(self) -> None:
        """POST /abort_request {"abort_all": true}."""
        await self.http.call("POST", "/abort_request", json_body={"abort_all": True})

    async def health(self) -> bool:
        """GET /health is 200."""
        return await self.http.ok("/health", HEALTH_TIMEOUT_S)

    async def weight_version(self) -> str:
        """From GET /model_info."""
        info = await self.http.json("GET", "/model_info")
        return str(info.get("weight_version", "default"))

    async def load(self) -> EngineLoad:
        """From GET /v1/loads (summed over data-parallel ranks)."""
        answer = await self.http.json("GET", "/v1/loads", params={"include": "core"})
        loads = answer.get("loads") if isinstance(answer, dict) else None
        loads = loads if isinstance(loads, list) else [answer]
        return EngineLoad(
            running=sum(int(x.get("num_running_reqs", 0)) for x in loads),
            waiting=sum(int(x.get("num_waiting_reqs", 0)) for x in loads),
        )

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()
