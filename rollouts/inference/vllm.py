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

import dataclasses
import logging
from collections.abc import Sequence
from typing import Unpack

from rollouts.inference.adapters import AdapterSlots
from rollouts.inference.http import EngineError, EngineHttp, EngineHttpArgs, EngineRequestError
from rollouts.inference.protocol import EngineLoad, TensorSpecLike, WeightGroupSpec, adapter_name
from rollouts.inference.sglang_wire import TopLogprobs
from rollouts.inference.versions import SyncBracket, completion_version
from rollouts.inference.vllm_wire import (
    completion_body,
    completion_request_id,
    parse_prompt_logprobs,
    parse_prompt_top_logprobs,
    prompt_logprobs_body,
    read_completion,
    reports_weight_versions,
    transfer_init_info,
    transfer_update_info,
)
from rollouts.wire.generation import (
    PAUSE_MODES,
    Completion,
    PauseMode,
    SamplingParams,
)

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0


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
            completion, spans, reports = await self.http.json(
                "POST", "/v1/completions", json_body=body, decode=read_completion
            )
        finally:
            self._in_flight -= 1
            if rid is not None:
                self._live_rids[rid] -= 1
                if not self._live_rids[rid]:
                    del self._live_rids[rid]
        self._note_reporting(reports)
        version = completion_version(
            spans=spans, reported=None, submitted=submitted, bracket=self.bracket
        )
        return dataclasses.replace(completion, weight_version=version)

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

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> tuple[float, ...]:
        """`prompt_logprobs: 0` of POST /v1/completions: the logprob of each of
        `input_ids[start:]` (vLLM scores the whole prompt: it has no start position)."""
        body = prompt_logprobs_body(input_ids, self.served())
        answer = await self.http.json("POST", "/v1/completions", json_body=body)
        return parse_prompt_logprobs(answer, input_ids, start)

    async def prompt_top_logprobs(
        self, input_ids: Sequence[int], top: int, start: int = 1
    ) -> tuple[tuple[float, ...], TopLogprobs]:
        """As `prompt_logprobs`, with the `top` likeliest (id, logprob) at each position."""
        body = prompt_logprobs_body(input_ids, self.served(), top)
        answer = await self.http.json("POST", "/v1/completions", json_body=body)
        return parse_prompt_logprobs(answer, input_ids, start), parse_prompt_top_logprobs(
            answer, input_ids, top, start
        )

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
