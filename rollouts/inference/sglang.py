"""SGLangEngine: the InferenceEngine Protocol over SGLang's native HTTP routes.

Works against SGLang itself and against the built-in server (`rollouts serve`), which answers
the same routes. Request bodies are built and answers parsed by the pure functions of
`sglang_wire.py`.
A LoRA adapter (SGLang with `--enable-lora`) is loaded with `/load_lora_adapter` and selected by
its name in each request's `lora_path`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any, Unpack

import trio

from rollouts.inference.adapters import AdapterSlots
from rollouts.inference.http import EngineError, EngineHttp, EngineHttpArgs, EngineRequestError
from rollouts.inference.protocol import (
    EngineLoad,
    TensorSpecLike,
    WeightGroupSpec,
    adapter_name,
)
from rollouts.inference.sglang_wire import (
    ReadAnswer,
    TopLogprobs,
    batch_generate_body,
    distributed_update_body,
    generate_body,
    init_group_body,
    input_logprobs_body,
    parse_input_logprobs,
    parse_input_top_logprobs,
    read_answers,
)
from rollouts.inference.versions import SyncBracket, completion_version
from rollouts.wire.generation import (
    PAUSE_MODES,
    Completion,
    GenerateRequest,
    PauseMode,
    SamplingParams,
)

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
WAIT_POLL_S = 0.05
# our pause modes -> SGLang's /pause_generation modes ("wait" has none: drain, then retract).
# Not "in_place": the reload flushes the prefix cache (stale KV must not outlive the weights), and
# SGLang refuses that flush (0.5.22+) or crashes on it (0.5.21) while an in_place pause holds
# running requests. "retract" moves them back to the waiting queue (outputs so far kept); they
# continue after /continue_generation, re-prefilled with the new weights (0.5.8+).
SGLANG_PAUSE = {"abort": "abort", "wait": "retract", "keep": "retract"}


class SGLangEngine:
    """InferenceEngine over SGLang's native API (`/generate`, `/update_weights_from_disk`, ...)."""

    def __init__(self, url: str, **http: Unpack[EngineHttpArgs]) -> None:
        self.http = EngineHttp(url, **http)
        self.url = self.http.url
        self._paused = False  # between this client's pause and resume
        self.adapters = AdapterSlots()  # LoRA adapters loaded here; requests name the newest
        self.bracket = SyncBracket()
        self._group_name = "weight_update_group"  # SGLang's default; set by init_weight_group

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """POST /generate with input_ids; an abort answers 200 with the partial output."""
        submitted = self.bracket.at_submit()
        body = generate_body(input_ids, sampling, rid, self.adapters.current)
        (answer,) = await self.http.json(
            "POST", "/generate", json_body=body, decode=functools.partial(read_answers, count=None)
        )
        return self._versioned(answer, submitted)

    batch_generate = True  # SGLang (and the built-in server) take a list of prompts

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """One batch POST /generate (a list of prompts, each with its own sampling params and
        rid); the answer is a list in the same order."""
        submitted = self.bracket.at_submit()
        body = batch_generate_body(requests, self.adapters.current)
        answers = await self.http.json(
            "POST",
            "/generate",
            json_body=body,
            decode=functools.partial(read_answers, count=len(requests)),
        )
        return [self._versioned(answer, submitted) for answer in answers]

    def _versioned(self, answer: ReadAnswer, submitted: tuple[str | None, int]) -> Completion:
        """A read answer's Completion, its version from the server or the bracket."""
        completion, spans, reported = answer
        version = completion_version(
            spans=spans, reported=reported, submitted=submitted, bracket=self.bracket
        )
        if version == completion.weight_version:
            return completion
        return dataclasses.replace(completion, weight_version=version)

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """POST /update_weights_from_disk; raises with the server's message on failure."""
        body = {
            "model_path": str(path),
            "load_format": None,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(version),
        }
        self.bracket.begin_sync()
        answer = await self.http.json("POST", "/update_weights_from_disk", json_body=body)
        if not answer.get("success", False):
            raise EngineError(f"{self.url}: weight update failed: {answer.get('message')}")
        self.bracket.served(str(version))

    async def load_adapter(self, path: str, version: str) -> None:
        """POST /load_lora_adapter as `adapter_name(version)`, then /update_weight_version;
        later requests name it in `lora_path`; adapters older than the one it replaces go."""
        name = adapter_name(version)
        body = {"lora_name": name, "lora_path": str(path)}
        self.bracket.begin_sync()
        try:
            await self._adapter_call("/load_lora_adapter", body)
        except EngineError as exc:  # loaded by an attempt whose answer was lost
            if "already" not in str(exc):
                raise
            await self._unload(name)
            await self._adapter_call("/load_lora_adapter", body)
        update = {"new_version": str(version), "abort_all_requests": False}
        await self.http.call("POST", "/update_weight_version", json_body=update)
        for stale in self.adapters.add(name):
            await self._unload(stale)
        self.bracket.served(str(version))

    async def _adapter_call(self, path: str, body: dict[str, Any]) -> None:
        """An adapter route: {"success", "error_message"}; a failure raises with the message."""
        answer = await self.http.json("POST", path, json_body=body)
        if not isinstance(answer, dict) or not answer.get("success", False):
            message = answer.get("error_message") if isinstance(answer, dict) else answer
            raise EngineError(f"{self.url}{path}: {message}")

    async def _unload(self, name: str) -> None:
        """POST /unload_lora_adapter; a name the server does not know is already gone."""
        self.adapters.forget(name)
        try:
            await self._adapter_call("/unload_lora_adapter", {"lora_name": name})
        except EngineError as exc:
            if isinstance(exc, EngineRequestError) and exc.status >= 500:
                raise
            log.info("%s: LoRA adapter %r was not unloaded (%s)", self.url, name, exc)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """POST /pause_generation: abort -> abort, keep -> retract; wait polls /v1/loads until
        nothing runs (bounded by the client timeout), then pauses with retract."""
        assert mode in PAUSE_MODES, f"{mode=} not in {PAUSE_MODES}"
        if mode == "wait":
            with trio.fail_after(self.http.options.timeout_s):
                while (await self.load()).total > 0:
                    await trio.sleep(WAIT_POLL_S)
        self._paused = True  # also if the call fails: the engine may have paused anyway
        await self.http.call("POST", "/pause_generation", json_body={"mode": SGLANG_PAUSE[mode]})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self.http.call("POST", "/continue_generation", json_body={})
        self._paused = False

    async def sleep(self, level: int) -> None:
        """Pause (abort), then POST /release_memory_occupation (every tag). Whether SGLang keeps
        the weights is its own flag (--enable-weights-cpu-backup): `level` cannot choose, and
        the caller reloads them after the wake-up either way."""
        assert level in (1, 2), f"{level=}"
        await self.pause("abort")  # SGLang refuses to release memory under running requests
        await self.http.call("POST", "/release_memory_occupation", json_body={"tags": None})

    async def wake_up(self) -> None:
        """POST /resume_memory_occupation (every tag), then /continue_generation."""
        await self.http.call("POST", "/resume_memory_occupation", json_body={"tags": None})
        await self.resume()

    async def abort_all(self) -> None:
        """POST /abort_request {"abort_all": true}."""
        await self.http.call("POST", "/abort_request", json_body={"abort_all": True})

    async def abort(self, rid_prefix: str) -> None:
        """POST /abort_request {"rid": prefix} (SGLang aborts every rid starting with it)."""
        assert rid_prefix, "an empty prefix would abort everything: use abort_all"
        await self.http.call("POST", "/abort_request", json_body={"rid": rid_prefix})

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> tuple[float, ...]:
        """POST /generate with `logprob_start_len`: the logprob of each of `input_ids[start:]`."""
        body = input_logprobs_body(input_ids, self.adapters.current, start=start)
        answer = await self.http.json("POST", "/generate", json_body=body)
        return parse_input_logprobs(answer, input_ids, start)

    async def prompt_top_logprobs(
        self, input_ids: Sequence[int], top: int, start: int = 1
    ) -> tuple[tuple[float, ...], TopLogprobs]:
        """As `prompt_logprobs`, with the `top` likeliest (id, logprob) at each position."""
        body = input_logprobs_body(input_ids, self.adapters.current, top, start)
        answer = await self.http.json("POST", "/generate", json_body=body)
        return parse_input_logprobs(answer, input_ids, start), parse_input_top_logprobs(
            answer, input_ids, top, start
        )

    async def health(self) -> bool:
        """GET /health is 200; while this client has the engine paused, GET /model_info is.

        SGLang's /health runs a one-token generation, which waits while generation is paused
        (503 after 20 s): a paused engine is alive, so liveness then uses a route that does not
        generate.
        """
        path = "/model_info" if self._paused else "/health"
        return await self.http.ok(path, HEALTH_TIMEOUT_S)

    async def server_version(self) -> str:
        """From GET /server_info (SGLang's "version"; the built-in server says "rollouts")."""
        info = await self.http.json("GET", "/server_info")
        info = info if isinstance(info, dict) else {}
        if info.get("engine") == "rollouts":
            return "rollouts built-in server"
        return f"sglang {info.get('version', 'unknown')}"

    async def weight_version(self) -> str:
        """From GET /model_info."""
        info = await self.http.json("GET", "/model_info")
        version = str(info.get("weight_version", "default"))
        self.bracket.served(version)
        return version

    async def load(self) -> EngineLoad:
        """From GET /v1/loads (summed over data-parallel ranks)."""
        answer = await self.http.json("GET", "/v1/loads", params={"include": "core"})
        loads = answer.get("loads") if isinstance(answer, dict) else None
        loads = loads if isinstance(loads, list) else [answer]
        return EngineLoad(
            running=sum(int(x.get("num_running_reqs", 0)) for x in loads),
            waiting=sum(int(x.get("num_waiting_reqs", 0)) for x in loads),
        )

    # ---- weight updates over a process group (SGLang's distributed protocol) ----
    weight_wire = "sglang"

    async def weight_group_size(self) -> int:
        """The server's tensor-parallel size (its ranks in the group), from GET /server_info."""
        info = await self.http.json("GET", "/server_info")
        return int(info.get("tp_size", 1)) if isinstance(info, dict) else 1

    async def init_weight_group(self, group: WeightGroupSpec, rank_offset: int) -> None:
        """POST /init_weights_update_group; answers once every rank joined."""
        self._group_name = group.group_name
        await self._weights_call("/init_weights_update_group", init_group_body(group, rank_offset))

    async def begin_weight_update(self) -> None:
        """POST /begin_weight_update (SGLang >= 0.5.21 needs it; older servers lack the route)."""
        self.bracket.begin_sync()
        await self._optional_call("/begin_weight_update", {})

    async def receive_weight_bucket(
        self, specs: Sequence[TensorSpecLike], *, version: str | None, flush_cache: bool
    ) -> None:
        """POST /update_weights_from_distributed for one bucket."""
        body = distributed_update_body(
            specs, group_name=self._group_name, version=version, flush_cache=flush_cache
        )
        await self._weights_call("/update_weights_from_distributed", body)

    async def finish_weight_update(self, version: str) -> None:
        """POST /end_weight_update (the version came with the last bucket)."""
        await self._optional_call("/end_weight_update", {})
        self.bracket.served(str(version))

    async def abort_weight_update(self) -> None:
        """POST /end_weight_update, so that the next update can begin."""
        await self._optional_call("/end_weight_update", {})

    async def destroy_weight_group(self, group_name: str) -> None:
        """POST /destroy_weights_update_group."""
        body = {"group_name": group_name}
        await self._weights_call("/destroy_weights_update_group", body)

    async def _weights_call(self, path: str, body: dict[str, Any]) -> None:
        answer = await self.http.json("POST", path, json_body=body)
        if not answer.get("success", False):
            raise EngineError(f"{self.url}{path}: {answer.get('message')}")

    async def _optional_call(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self._weights_call(path, body)
        except EngineRequestError as exc:
            if exc.status != 404:
                raise

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()
