"""SGLang's own HTTP app (`sglang.srt.entrypoints.http_server.app`) with a stub model behind it.

The routes, request models (GenerateReqInput, PauseGenerationReqInput, UpdateWeight*ReqInput,
AbortReq), the /generate contract check and SamplingParams validation are SGLang's. What stands
in for the TokenizerManager + scheduler is `StubTokenizerManager`: it makes up tokens (one every
`STEP_S`), keeps SGLang's pause semantics (abort / retract / in_place; a weight update that
flushes the cache is refused while an in_place pause holds running requests, as the scheduler's
`flush_cache` does) and builds meta_info with SGLang's own finish-reason and weight-version-span
code. LoRA adapters: SGLang's /load_lora_adapter and /unload_lora_adapter routes and request
models (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, LoRAUpdateOutput) with the stub
keeping the names (a /generate naming an adapter it has not loaded fails, as SGLang's does).
Sleep: /release_memory_occupation and /resume_memory_occupation (their request models), the stub
refusing a release under running requests as SGLang's scheduler does.
Run only inside `.venv-protocols` (scripts/test_protocols.sh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from types import SimpleNamespace
from typing import Any

STEP_S = 0.02


@dataclasses.dataclass
class Run:
    """One request being generated."""

    rid: str
    prompt: list[int]
    max_new: int
    version_events: list[Any] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)
    aborted: bool = False


class StubTokenizerManager:
    """What the routes call on `_global_state.tokenizer_manager`, over a made-up model."""

    def __init__(self, server_args: Any, hf_config: Any) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_args = server_args
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.is_generation = True
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}
        self.vocab_size = int(hf_config.vocab_size)
        self.model_config = SimpleNamespace(
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
            hf_config=hf_config,
            vocab_size=self.vocab_size,
        )
        self.weight_version = server_args.weight_version
        self.paused: str | None = None
        self.runs: dict[str, Run] = {}
        self.startup_time = time.time()
        self.bodies: list[tuple[str, Any]] = []  # what each control call received
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> path
        self.lora_paths: list[Any] = []  # each /generate prompt's lora_path
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation)

    def config_value(self, key: str) -> Any:
        if key == "weight_version":
            return self.weight_version
        return getattr(self.server_args, key, None)

    def _check_sampling(self, params: dict[str, Any]) -> None:
        """SGLang's own SamplingParams: unknown keys and bad values raise ValueError/TypeError."""
        from sglang.srt.sampling.sampling_params import SamplingParams

        try:
            sp = SamplingParams(**params)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        sp.normalize(None)
        sp.verify(self.vocab_size)

    async def generate_request(self, obj: Any, request: Any = None):
        """One prompt, or a batch (a GRPO group: SGLang's own normalisation splits it into one
        request per prompt, each with its rid); yields the finished answer (a list) once."""
        obj.normalize_batch_and_arguments()
        if obj.is_single:
            yield await self._one(obj)
            return
        yield list(await asyncio.gather(*(self._one(obj[i]) for i in range(obj.batch_size))))

    async def _one(self, obj: Any) -> dict[str, Any]:
        self._check_sampling(dict(obj.sampling_params or {}))
        lora = getattr(obj, "lora_path", None)
        if lora is not None and lora not in self.adapters:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {lora}")
        self.lora_paths.append(lora)
        while self.paused is not None:
            await asyncio.sleep(STEP_S)
        params = obj.sampling_params or {}
        rid = obj.rid or uuid.uuid4().hex
        run = Run(rid=rid, prompt=list(obj.input_ids), max_new=params.get("max_new_tokens", 128))
        self.runs[rid] = run
        start = time.monotonic()
        try:
            while len(run.output) < run.max_new and not run.aborted:
                await asyncio.sleep(STEP_S)
                if self.paused is None:
                    run.output.append((run.prompt[-1] + len(run.output) + 1) % self.vocab_size)
                    self.last_receive_tstamp = time.time()
        finally:
            self.runs.pop(rid, None)
        return self._answer(obj, run, time.monotonic() - start)

    def _answer(self, obj: Any, run: Run, latency_s: float) -> dict[str, Any]:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
        from sglang.srt.utils.weight_versions import (
            add_weight_versions_to_meta_info,
            compute_weight_version_spans,
        )

        reason = FINISH_ABORT() if run.aborted else FINISH_LENGTH(length=len(run.output))
        meta: dict[str, Any] = {
            "id": run.rid,
            "finish_reason": reason.to_json(),
            "prompt_tokens": len(run.prompt),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(run.output),
            "cached_tokens": 0,
            "e2e_latency": latency_s,
        }
        if run.version_events:
            spans = compute_weight_version_spans(
                run.version_events, self.weight_version, len(run.output)
            )
            add_weight_versions_to_meta_info(meta, spans, len(run.output))
        if obj.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(-0.5, t, None) for t in run.output]
        return {"text": "x" * len(run.output), "output_ids": run.output, "meta_info": meta}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.bodies.append(("abort_request", {"rid": rid, "abort_all": abort_all}))
        for run in self.runs.values():
            if abort_all or run.rid.startswith(rid or "\0"):
                run.aborted = True

    def create_abort_task(self, obj: Any) -> None:
        return None

    async def pause_generation(self, obj: Any) -> None:
        self.bodies.append(("pause_generation", obj.mode))
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
        self.paused = obj.mode

    async def continue_generation(self, obj: Any) -> None:
        self.bodies.append(("continue_generation", None))
        self.paused = None

    async def update_weights_from_disk(self, obj: Any, request: Any = None):
        from sglang.srt.utils.weight_versions import WeightVersionEvent

        self.bodies.append(("update_weights_from_disk", obj.model_path))
        if obj.flush_cache and self.paused == "in_place" and self.runs:
            return False, "Cache not flushed: requests are running (in_place pause)", 0
        for run in self.runs.values():
            if run.output:
                run.version_events.append(WeightVersionEvent(self.weight_version, len(run.output)))
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update model weights.", 0

    async def update_weight_version(self, obj: Any) -> None:
        self.bodies.append(("update_weight_version", obj.new_version))
        self.weight_version = obj.new_version

    def _lora_answer(self, error: str | None) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        return LoRAUpdateOutput(
            success=error is None, error_message=error, loaded_adapters=dict(self.adapters)
        )

    async def load_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        self.bodies.append(("load_lora_adapter", (obj.lora_name, obj.lora_path)))
        if obj.lora_name in self.adapters:
            return self._lora_answer(f"LoRA adapter {obj.lora_name!r} is already loaded")
        self.adapters[obj.lora_name] = obj.lora_path
        return self._lora_answer(None)

    async def unload_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        self.bodies.append(("unload_lora_adapter", obj.lora_name))
        if self.adapters.pop(obj.lora_name, None) is None:
            return self._lora_answer(f"LoRA adapter {obj.lora_name!r} is not loaded")
        return self._lora_answer(None)

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        """SGLang's scheduler asserts the server idle (waiting requests aside when paused)."""
        self.bodies.append(("release_memory_occupation", obj.tags))
        running = [r for r in self.runs.values() if not r.aborted]
        assert not running or self.paused is not None, (
            "release_memory_occupation should be called only when server is idle."
        )
        self.released = set(obj.tags or ("weights", "kv_cache", "cuda_graph"))

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.bodies.append(("resume_memory_occupation", obj.tags))
        self.released -= set(obj.tags or ("weights", "kv_cache", "cuda_graph"))

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[Any]:
        from sglang.srt.managers.load_snapshot import LoadSnapshot

        running = 0 if self.paused else len(self.runs)
        return [LoadSnapshot(num_running_reqs=running, num_waiting_reqs=len(self.runs) - running)]

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{}]


def build_app(model_dir: str) -> tuple[Any, StubTokenizerManager]:
    """SGLang's app with the stub behind it, and the stub (to read what it received)."""
    from sglang.srt import runtime_context
    from sglang.srt.entrypoints import http_server
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    server_args = ServerArgs(model_path=model_dir, device="cpu", skip_server_warmup=True)
    runtime_context.publish(server_args, role="test")
    stub = StubTokenizerManager(server_args, AutoConfig.from_pretrained(model_dir))
    http_server.set_global_state(
        http_server._GlobalState(tokenizer_manager=stub, template_manager=None, scheduler_info={})
    )
    return http_server.app, stub


def version() -> str:
    """The SGLang version whose app this is."""
    import sglang

    return str(sglang.__version__)
