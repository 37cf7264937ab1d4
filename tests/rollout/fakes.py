"""An in-process engine that follows the InferenceEngine Protocol (a fake, not a mock).

It "generates" scripted token ids (or a deterministic pattern), one token per trio checkpoint
while a request is live, and honours `abort_all` by returning the partial output with finish
reason ABORT, like the real servers. Used where a test needs a known conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from rollouts.inference.protocol import Completion, EngineLoad, FinishReason, SamplingParams


class ScriptedEngine:
    """Answers each request with the next scripted reply (token ids), in order."""

    url = "fake://scripted"

    def __init__(self, replies: Sequence[Sequence[int]], eos_id: int, version: str = "0"):
        self.replies = [tuple(r) for r in replies]
        self.eos_id = eos_id
        self.version = version
        self.requests: list[tuple[tuple[int, ...], SamplingParams]] = []
        self.running = 0

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        self.requests.append((tuple(input_ids), sampling))
        reply = self.replies.pop(0)[: sampling.max_new_tokens]
        await trio.lowlevel.checkpoint()
        stopped = bool(reply) and reply[-1] == self.eos_id
        return Completion(
            output_ids=reply,
            logprobs=tuple(-0.5 for _ in reply),
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            weight_version=self.version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(reply),
        )

    async def abort_all(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load(self) -> EngineLoad:
        return EngineLoad(running=self.running, waiting=0)
