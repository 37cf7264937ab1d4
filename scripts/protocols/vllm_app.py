"""vLLM's own routers, request and response models, with a stub engine behind them.

Mounted as in `vllm serve` with VLLM_SERVER_DEV_MODE=1: `/v1/completions` (CompletionRequest,
`to_sampling_params`, CompletionResponse), the RL routes (`/pause`, `/resume`,
`/abort_requests`, `/update_weight_version`, `/weight_info`), `/collective_rpc`, `/health`,
`/version`, `/sleep`, `/wake_up`, `/is_sleeping`, and vLLM's exception handlers. What stands
in for AsyncLLM and the serving object is
`StubLLM` (an AsyncLLM subclass, as `/abort_requests` asserts) and `StubCompletions`: made-up
tokens, vLLM's pause modes, the answer built from vLLM's own response models. Run only inside
`.venv-protocols` (scripts/test_protocols.sh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

STEP_S = 0.02


@dataclasses.dataclass
class Run:
    rid: str
    prompt: list[int]
    max_new: int
    events: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (old version, at)
    output: list[int] = dataclasses.field(default_factory=list)
    aborted: bool = False


def stub_llm_class() -> type:
    from vllm.v1.engine.async_llm import AsyncLLM

    class StubLLM(AsyncLLM):
        """AsyncLLM's interface over made-up tokens (its __init__ would start an engine)."""

        def __init__(self) -> None:
            from types import SimpleNamespace

            self.paused: str | None = None
            self.version = "default"
            self.runs: dict[str, Run] = {}
            self.output_processor = SimpleNamespace(request_states=self.runs, parent_requests={})
            self.calls: list[tuple[str, Any]] = []
            self.asleep: set[str] = set()

        async def check_health(self) -> None:
            return None

        async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
            self.calls.append(("pause", mode))
            if mode == "abort":
                await self.abort(list(self.runs), internal=True)
            while mode == "wait" and self.runs:
                await asyncio.sleep(STEP_S)
            self.paused = mode

        async def resume_generation(self) -> None:
            self.calls.append(("resume", None))
            self.paused = None

        async def is_paused(self) -> bool:
            return self.paused is not None

        async def sleep(self, level: int = 1, mode: str = "abort") -> None:
            """The scheduler paused in `mode`, then the memory of `level` released."""
            self.calls.append(("sleep", (level, mode)))
            await self.pause_generation(mode=mode)
            self.asleep = {"weights", "kv_cache"} if level else set()

        async def wake_up(self, tags: list[str] | None = None) -> bool:
            self.calls.append(("wake_up", tags))
            self.asleep -= set(tags or ("weights", "kv_cache"))
            if not self.asleep:
                self.paused = None
            return not self.asleep

        async def is_sleeping(self) -> bool:
            return bool(self.asleep) or self.paused is not None

        async def abort(self, request_id: Any, internal: bool = False) -> None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            for rid in ids:
                if rid in self.runs:
                    self.runs[rid].aborted = True

        async def collective_rpc(self, method: str, timeout: Any = None, args=(), kwargs=None):
            self.calls.append(("collective_rpc", (method, kwargs)))
            assert method == "reload_weights" and "weights_path" in (kwargs or {}), kwargs
            for run in self.runs.values():
                if run.output:
                    run.events.append((self.version, len(run.output)))
            return [None]

        async def update_weight_version(self, new_version: str) -> None:
            self.calls.append(("update_weight_version", new_version))
            self.version = new_version

        async def get_weight_version(self) -> str:
            return self.version

        async def run(self, rid: str, prompt: list[int], max_new: int) -> Run:
            if self.paused in ("abort", "wait"):  # new requests: 503 until /resume
                from fastapi import HTTPException

                raise HTTPException(503, "paused")
            run = Run(rid=rid, prompt=prompt, max_new=max_new)
            self.runs[rid] = run
            try:
                while len(run.output) < max_new and not run.aborted:
                    await asyncio.sleep(STEP_S)
                    if self.paused is None:
                        run.output.append((prompt[-1] + len(run.output) + 1) % 256)
            finally:
                self.runs.pop(rid, None)
            return run

    return StubLLM


class StubCompletions:
    """`create_completion` over the stub: vLLM's request validation and response models."""

    def __init__(self, llm: Any, model: str) -> None:
        self.llm, self.model = llm, model

    async def create_completion(self, request: Any, raw_request: Any) -> Any:
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionLogProbs,
            CompletionResponse,
            CompletionResponseChoice,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        params = request.to_sampling_params(request.max_tokens or 16)  # vLLM's own checks
        prompt = list(request.prompt)
        run = await self.llm.run(request.request_id, prompt, params.max_tokens)
        n = len(run.output)
        name = (lambda t: f"token_id:{t}") if request.return_tokens_as_token_ids else str
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogProbs(
                text_offset=list(range(n)),
                token_logprobs=[-0.5] * n,
                tokens=[name(t) for t in run.output],
                top_logprobs=[{name(t): -0.5} for t in run.output],
            )
        choice = CompletionResponseChoice(
            index=0,
            text="x" * n,
            logprobs=logprobs,
            finish_reason="abort" if run.aborted else "length",
            token_ids=run.output if request.return_token_ids else None,
            prompt_token_ids=prompt if request.return_token_ids else None,
        )
        # vLLM 0.33+ reports the versions that sampled the tokens; older ones ignore the field
        if getattr(request, "return_weight_versions", False):
            choice.weight_versions = self._spans(run, n)
        usage = UsageInfo(
            prompt_tokens=len(prompt), completion_tokens=n, total_tokens=len(prompt) + n
        )
        return CompletionResponse(model=self.model, choices=[choice], usage=usage)

    def _spans(self, run: Run, n: int) -> list[Any] | None:
        from vllm.outputs import WeightVersionSpan

        spans, start = [], 0
        for version, end in [*run.events, (self.llm.version, n)]:
            if end > start:
                spans.append(WeightVersionSpan(version=version, start=start, end=end))
                start = end
        return spans or None


def build_app(model_dir: str) -> tuple[Any, Any]:
    """A FastAPI app with vLLM's routers and exception handlers, and the stub engine."""
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    from fastapi import FastAPI
    from vllm.entrypoints.openai.completion import api_router as completion
    from vllm.entrypoints.rl.online import api_router as rl
    from vllm.entrypoints.serve.dev.rpc import api_router as rpc
    from vllm.entrypoints.serve.dev.sleep import api_router as sleep
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.instrumentator import basic, health

    app = FastAPI()
    for module in (completion, rl, rpc, sleep, basic, health):
        app.include_router(module.router)
    init_exception_handler(app)
    llm = stub_llm_class()()
    app.state.engine_client = llm
    app.state.openai_serving_completion = StubCompletions(llm, model_dir)
    app.state.enable_server_load_tracking = False
    app.state.server_load_metrics = 0
    app.state.args = None
    return app, llm


def version() -> str:
    """The vLLM version whose routers these are."""
    from vllm import __version__

    return str(__version__)
