"""An in-process engine that follows the InferenceEngine Protocol (a fake, not a mock).

It "generates" scripted token ids (or a deterministic pattern), one token per trio checkpoint
while a request is live, and honours `abort_all` by returning the partial output with finish
reason ABORT, like the real servers. Used where a test needs a known conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from rollouts.inference.protocol import EngineLoad
from rollouts.wire.generation import Completion, FinishReason, SamplingParams


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

    async def abort(self, rid_prefix: str) -> None:
        await trio.lowlevel.checkpoint()

    async def load(self) -> EngineLoad:
        return EngineLoad(running=self.running, waiting=0)


class RandomEngine:
    """Random tokens, one per trio checkpoint; `abort_all` cuts live requests short.

    `eos_prob` makes some samples stop early, so groups differ in length.
    """

    url = "fake://random"

    def __init__(self, eos_id: int, seed: int = 0, eos_prob: float = 0.1, version: str = "0"):
        import random

        self.rng = random.Random(seed)
        self.eos_id = eos_id
        self.eos_prob = eos_prob
        self.version = version
        self.live: dict[int, bool] = {}  # request number -> aborted
        self.rids: dict[int, str] = {}  # request number -> request id
        self.count = 0
        self.tokens_generated = 0

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        key = self.count
        self.count += 1
        self.live[key] = False
        self.rids[key] = rid or ""
        out: list[int] = []
        reason = FinishReason.LENGTH
        try:
            while len(out) < sampling.max_new_tokens:
                await trio.sleep(0.001)  # decode time: lets aborts arrive mid-request
                if self.live[key]:
                    reason = FinishReason.ABORT
                    break
                token = (
                    self.eos_id if self.rng.random() < self.eos_prob else self.rng.randrange(3, 90)
                )
                out.append(token)
                if token == self.eos_id:
                    reason = FinishReason.STOP
                    break
        finally:
            del self.live[key], self.rids[key]
        self.tokens_generated += len(out)
        return Completion(
            output_ids=tuple(out),
            logprobs=tuple(-1.0 for _ in out),
            finish_reason=reason,
            weight_version=self.version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(out),
        )

    async def abort_all(self) -> None:
        for key in self.live:
            self.live[key] = True
        await trio.lowlevel.checkpoint()

    async def abort(self, rid_prefix: str) -> None:
        for key in self.live:
            self.live[key] = self.live[key] or self.rids[key].startswith(rid_prefix)
        await trio.lowlevel.checkpoint()

    async def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.live), waiting=0)
