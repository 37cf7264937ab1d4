"""VLLMEngine: the InferenceEngine Protocol over vLLM's OpenAI-compatible server.

Generation is `/v1/completions` with token-id prompts, `return_token_ids` and `logprobs: 0`
(the sampled token's logprob only). Weight reload, pause and abort use vLLM's dev-mode routes
(`VLLM_SERVER_DEV_MODE=1`, vLLM >= 0.27): `/collective_rpc reload_weights` then
`/update_weight_version {"new_version"}`. A LoRA adapter (`--enable-lora`,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) is loaded with `/v1/load_lora_adapter` and selected by
naming it in each request's `model`. vLLM < 0.33 ignores `return_weight_versions`: the
client then says so once and takes each sample's version from its sync bracket (`versions.py`).
The built-in server answers the same routes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Unpack

from rollouts.inference.adapters import AdapterSlots
from rollouts.inference.http import EngineError, EngineHttp, EngineHttpArgs, EngineRequestError
from rollouts.inference.protocol import EngineLoad, TensorSpecLike, WeightGroupSpec, adapter_name
from rollouts.inference.sglang_wire import shared_sampling_fields
from rollouts.inference.versions import SyncBracket, completion_version, span_versions
from rollouts.wire.generation import (
    PAUSE_MODES,
    Completion,
    FinishReason,
    PauseMode,
    SamplingParams,
)

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
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


def prompt_logprobs_body(input_ids: Sequence[int], model: str | None) -> dict[str, Any]:
    """POST /v1/completions asking for the prompt tokens' logprobs (one output token)."""
    assert len(input_ids) >= 2, "a prompt-logprobs probe needs two tokens"
    body: dict[str, Any] = {
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "seed": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    return body


def parse_prompt_logprobs(answer: Any, input_ids: Sequence[int]) -> tuple[float, ...]:
    """`choices[0].prompt_logprobs` (null, then {token id: {logprob, rank, ...}} per position)
    -> the logprob of each of `input_ids[1:]`."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    entries = choices[0].get("prompt_logprobs") if choices else None
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise EngineError(f"/v1/completions gave no prompt_logprobs for the prompt: {entries!r}")
    out = []
    for t in range(1, len(input_ids)):
        entry = (entries[t] or {}).get(str(input_ids[t]))
        if not isinstance(entry, dict) or entry.get("logprob") is None:
            raise EngineError(f"prompt_logprobs[{t}] has no entry for token {input_ids[t]}")
        out.append(float(entry["logprob"]))
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


class VLLMEngine:
    """InferenceEngine over vLLM's OpenAI-compatible API (dev mode for weights and pause)."""

    def __init__(
        self, url: str, *, model: str | None = None, **http: Unpack[EngineHttpArgs]
    ) -> None:
        self.http = EngineHttp(url, **http)
        self.url = self.http.url
        self.model = model  # the served model's name (None: not sent)
        self.adapters = AdapterSlots()  # LoRA adapters loaded here; requests name the newest
        self.bracket = SyncBracket()
        self.reports_versions: bool | None = None  # does the server answer weight_versions?
        self._in_flight = 0
        self._live_rids: dict[str, int] = {}  # request ids in flight (vLLM aborts exact ids)

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """POST /v1/completions with a token-id prompt."""
        if self.bracket.version is None and self.reports_versions is not True:
            await self.weight_version()  # the bracket needs a starting version
        body = completion_body(input_ids, sampling, rid, self.served())
        submitted = self.bracket.at_submit()
        self._in_flight += 1
        if rid is not None:
            self._live_rids[rid] = self._live_rids.get(rid, 0) + 1
        try:
            answer = await self.http.json("POST", "/v1/completions", json_body=body)
        finally:
            self._in_flight -= 1
            if rid is not None:
                self._live_rids[rid] -= 1
                if not self._live_rids[rid]:
                    del self._live_rids[rid]
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else {}
        self._note_reporting("weight_versions" in choice)
        spans = span_versions(choice.get("weight_versions"))
        version = completion_version(
            spans=spans, reported=None, submitted=submitted, bracket=self.bracket
        )
        return parse_completion(answer, version)

    def _note_reporting(self, reports: bool) -> None:
        """Say once when the server does not report weight versions (vLLM < 0.33)."""
        if self.reports_versions is None and not reports:
            log.warning(
                "%s does not report weight versions per request (return_weight_versions needs "
                "vLLM >= 0.33): each sample's version comes from this client's pause/sync "
                "bracket (exact unless a sync ran during the request, then the older version)",
                self.url,
            )
        self.reports_versions = reports if self.reports_versions is None else self.reports_versions

    async def server_version(self) -> str:
        """GET /version; says at once (and once) if this vLLM does not report weight versions."""
        answer = await self.http.json("GET", "/version")
        version = str(answer.get("version", "unknown")) if isinstance(answer, dict) else "unknown"
        reports = reports_weight_versions(version)
        if reports is not None:
            self._note_reporting(reports)
        return f"vllm {version}"

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """`/collective_rpc reload_weights` from `path`, then `/update_weight_version`."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        self.bracket.begin_sync()
        await self.http.call("POST", "/collective_rpc", json_body=rpc)
        await self._set_version(str(version))
        self.bracket.served(str(version))

    def served(self) -> str | None:
        """The `model` requests name: the newest LoRA adapter, else the configured model."""
        return self.adapters.current or self.model

    async def load_adapter(self, path: str, version: str) -> None:
        """POST /v1/load_lora_adapter as `adapter_name(version)`, `/update_weight_version`;
        later requests name it; adapters older than the one it replaces are unloaded."""
        name = adapter_name(version)
        body = {"lora_name": name, "lora_path": str(path)}
        self.bracket.begin_sync()
        try:
            await self.http.call("POST", "/v1/load_lora_adapter", json_body=body)
        except EngineRequestError as exc:  # loaded by an attempt whose answer was lost
            if exc.status != 400 or "already" not in exc.message:
                raise
            await self._unload(name)
            await self.http.call("POST", "/v1/load_lora_adapter", json_body=body)
        await self._set_version(str(version))
        for stale in self.adapters.add(name):
            await self._unload(stale)
        self.bracket.served(str(version))

    async def _unload(self, name: str) -> None:
        """POST /v1/unload_lora_adapter; a name the server does not know is already gone."""
        self.adapters.forget(name)
        try:
            await self.http.call("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})
        except EngineRequestError as exc:
            if exc.status not in (400, 404):
                raise
            log.info("%s: LoRA adapter %r was not loaded (%s)", self.url, name, exc.message)

    async def _set_version(self, version: str) -> None:
        answer = await self.http.json(
            "POST", "/update_weight_version", json_body={"new_version": version}
        )
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineError(f"{self.url}: /update_weight_version answered {answer!r}")

    async def pause(self, mode: PauseMode = "abort") -> None:
        """POST /pause?mode=abort|wait|keep."""
        assert mode in PAUSE_MODES, f"{mode=} not in {PAUSE_MODES}"
        await self.http.call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """POST /resume."""
        await self.http.call("POST", "/resume")

    async def sleep(self, level: int) -> None:
        """POST /sleep?level=&mode=abort (vLLM needs --enable-sleep-mode, on CUDA)."""
        assert level in (1, 2), f"{level=}"
        await self.http.call("POST", "/sleep", params={"level": str(level), "mode": "abort"})

    async def wake_up(self) -> None:
        """POST /wake_up (every tag: weights, KV cache, scheduling)."""
        answer = await self.http.json("POST", "/wake_up")
        if not isinstance(answer, dict) or answer.get("status") != "awake":
            raise EngineError(f"{self.url}/wake_up answered {answer!r}, not fully awake")

    async def abort_all(self) -> None:
        """POST /abort_requests with no ids (= all)."""
        await self.http.call("POST", "/abort_requests", json_body={"request_ids": []})

    async def abort(self, rid_prefix: str) -> None:
        """POST /abort_requests with the ids of this client's in-flight requests whose rid starts
        with the prefix. vLLM matches exact external ids, and a completion's is
        `cmpl-<request_id>-<prompt index>` (`completion_request_id`): the bare rid aborts
        nothing, while vLLM still answers 200. Nothing is sent when none is in flight."""
        assert rid_prefix, "an empty prefix would abort everything: use abort_all"
        ids = sorted(completion_request_id(r) for r in self._live_rids if r.startswith(rid_prefix))
        if ids:
            await self.http.call("POST", "/abort_requests", json_body={"request_ids": ids})

    async def health(self) -> bool:
        """GET /health is 200 (vLLM's does not generate: it also answers while paused)."""
        return await self.http.ok("/health", HEALTH_TIMEOUT_S)

    async def weight_version(self) -> str:
        """From GET /weight_info (also what the sync bracket starts from)."""
        info = await self.http.json("GET", "/weight_info")
        if not isinstance(info, dict) or info.get("weight_version") is None:
            raise EngineError(f"{self.url}/weight_info has no weight_version: {info!r}")
        self.bracket.served(str(info["weight_version"]))
        return str(info["weight_version"])

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> tuple[float, ...]:
        """`prompt_logprobs: 0` of POST /v1/completions: each prompt token's logprob."""
        body = prompt_logprobs_body(input_ids, self.served())
        answer = await self.http.json("POST", "/v1/completions", json_body=body)
        return parse_prompt_logprobs(answer, input_ids)

    async def load(self) -> EngineLoad:
        """vLLM has no load route in its API: this client's own in-flight requests."""
        return EngineLoad(running=self._in_flight, waiting=0)

    # ---- weight updates over NCCL (vLLM's weight-transfer engine, dev mode) ----
    weight_wire = "vllm"

    async def weight_group_size(self) -> int:
        """The server's workers (TP x PP x DP), from GET /get_world_size."""
        answer = await self.http.json("GET", "/get_world_size")
        return int(answer.get("world_size", 1)) if isinstance(answer, dict) else 1

    async def init_weight_group(self, group: WeightGroupSpec, rank_offset: int) -> None:
        """POST /init_weight_transfer_engine; answers once every rank joined.

        vLLM's transfer backend is chosen on its command line (`--weight-transfer-config`);
        the group name and backend of `group` are not sent.
        """
        body = {"init_info": transfer_init_info(group, rank_offset)}
        await self.http.call("POST", "/init_weight_transfer_engine", json_body=body)

    async def begin_weight_update(self) -> None:
        """POST /start_weight_update."""
        self.bracket.begin_sync()
        await self.http.call("POST", "/start_weight_update", json_body={})

    async def receive_weight_bucket(
        self, specs: Sequence[TensorSpecLike], *, version: str | None, flush_cache: bool
    ) -> None:
        """POST /update_weights with the bucket's names, dtypes and shapes (sent one by one)."""
        body = {"update_info": transfer_update_info(specs)}
        await self.http.call("POST", "/update_weights", json_body=body)

    async def finish_weight_update(self, version: str) -> None:
        """POST /finish_weight_update with the new version."""
        body = {"weight_version": str(version)}
        await self.http.call("POST", "/finish_weight_update", json_body=body)
        self.bracket.served(str(version))

    async def abort_weight_update(self) -> None:
        """POST /finish_weight_update without a version (the old one stays reported)."""
        await self.http.call("POST", "/finish_weight_update", json_body={})

    async def destroy_weight_group(self, group_name: str) -> None:
        """POST /shutdown_weight_transfer_engine (vLLM >= 0.33; older servers lack it)."""
        try:
            await self.http.call("POST", "/shutdown_weight_transfer_engine", json_body={})
        except EngineRequestError as exc:
            if exc.status != 404:
                raise

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()
