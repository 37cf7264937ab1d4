"""The InferenceEngine Protocol: the only way the loop talks to an inference server.

SGLang, vLLM and the built-in server are all reached through it; the loop never knows which.
The records of a generation (`SamplingParams`, `Completion`, ...) are in `rollouts/wire/`
(the environments and the built-in engine use them too); the clients translate them to and
from each server's wire format (`../shared/reference/engine-protocols.md`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rollouts.wire.generation import Completion, GenerateRequest, PauseMode, SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineLoad:
    """How busy an engine is (running + waiting requests)."""

    running: int
    waiting: int

    @property
    def total(self) -> int:
        return self.running + self.waiting


@runtime_checkable
class InferenceEngine(Protocol):
    """A generation server reached over HTTP. Every call is bounded by a timeout."""

    url: str

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> Completion:
        """Generate one continuation of `input_ids`; an abort returns the partial output."""
        ...

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        """Load HF-format weights from `path`; afterwards the engine serves `version`."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating: "abort" in-flight requests, "wait" for them, or "keep" them."""
        ...

    async def resume(self) -> None:
        """Undo `pause`."""
        ...

    async def abort_all(self) -> None:
        """Abort every in-flight request (they return partial output, finish reason ABORT)."""
        ...

    async def abort(self, rid_prefix: str) -> None:
        """Abort only the in-flight requests whose request id starts with `rid_prefix` (one
        batch's requests), leaving every other request (an evaluation, another batch) alone."""
        ...

    async def health(self) -> bool:
        """True when the engine answers its health route with 200."""
        ...

    async def weight_version(self) -> str:
        """The weight version the engine serves now."""
        ...

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1) -> tuple[float, ...]:
        """The served weights' logprob of each of `input_ids[start:]` (1 <= start <
        len(input_ids)) given the tokens before it (raw logits, teacher-forced): what a weight
        sync's content check compares (start 1), and a teacher's opinion of a response (start:
        its first token; the engine need not score the prompt's positions)."""
        ...

    async def prompt_top_logprobs(
        self, input_ids: Sequence[int], top: int, start: int = 1
    ) -> tuple[tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]:
        """`prompt_logprobs`, and at each of those positions the `top` likeliest (token id,
        logprob) in rank order: a teacher's distribution for top-k distillation."""
        ...

    async def load(self) -> EngineLoad:
        """Running and waiting request counts."""
        ...

    async def aclose(self) -> None:
        """Close the HTTP client."""
        ...


@runtime_checkable
class BatchGenerator(Protocol):
    """An engine that takes several prompts in one request (SGLang's batch /generate).

    The rollout manager sends a GRPO group's samples as one `generate_many` call where
    `batch_generate` is true (one HTTP round trip instead of n; the server prefills the shared
    prompt once). Each request keeps its own rid, so aborting by rid prefix still reaches each.
    """

    batch_generate: bool

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """One completion per request, in order; an abort returns each one's partial output."""
        ...


def batches_requests(engine: object) -> bool:
    """Whether `engine` takes a group's prompts as one request (`BatchGenerator`): its members
    looked up as `isinstance(engine, BatchGenerator)` looks them up, in 0.3 us against 19 (a pool
    asks each of its engines on every group's request)."""
    return hasattr(engine, "generate_many") and bool(getattr(engine, "batch_generate", False))


@runtime_checkable
class AdapterLoader(Protocol):
    """An engine that loads LoRA adapters at run time (vLLM and SGLang with `--enable-lora`, the
    built-in server): an adapter sync gives it the adapter alone (`weight_sync.lora`)."""

    url: str

    async def load_adapter(self, path: str, version: str) -> None:
        """Load the PEFT adapter directory `path` under `version`'s name (`adapter_name`),
        address every later request (prompt logprobs too) to it, and serve `version`. The
        adapter it replaces stays loaded (requests in flight may name it); older ones go."""
        ...


@runtime_checkable
class Sleeper(Protocol):
    """An engine that releases its memory while a colocated trainer trains (vLLM's dev-mode
    /sleep and /wake_up, SGLang's /release_memory_occupation and /resume_memory_occupation, the
    built-in server's same routes): `engines.sleep_level`."""

    url: str

    async def sleep(self, level: int) -> None:
        """Abort what runs, then release memory: 1 keeps the weights in host memory, 2 discards
        them (what a sleeping SGLang does without --enable-weights-cpu-backup). Requests sent
        while asleep wait; after a wake-up of level 2 the weights must be reloaded."""
        ...

    async def wake_up(self) -> None:
        """Take the memory back and generate again."""
        ...


def adapter_name(version: str) -> str:
    """The name an engine knows the adapter of weight version `version` by."""
    return f"policy-v{version}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightGroupSpec:
    """The trainer's weight-update process group, as the engines are told to join it."""

    master_address: str
    master_port: int
    world_size: int  # 1 (the trainer, rank 0) + every engine's ranks
    group_name: str = "rollouts_weights"
    backend: str = "gloo"  # "gloo" | "nccl"

    def __post_init__(self) -> None:
        assert self.world_size >= 2, f"{self.world_size=}: the trainer and at least one engine"
        assert 0 < self.master_port < 65536, f"{self.master_port=}"
        assert self.backend in ("gloo", "nccl"), f"{self.backend=}"


class TensorSpecLike(Protocol):
    """What a receiver reads of one tensor of a bucket (`weight_group.TensorSpec`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine that takes new weights as broadcasts over a process group with the trainer.

    `weight_wire` says how the trainer must send: "sglang" (a torch.distributed group,
    SGLang's flattened buckets; SGLang and the built-in server) or "vllm" (vLLM's NCCL weight
    transfer engine, tensor by tensor). One sync: begin -> one receive per bucket, each started
    BEFORE the trainer broadcasts that bucket -> finish.
    """

    url: str
    weight_wire: str

    async def weight_group_size(self) -> int:
        """How many ranks of the group this engine takes (its tensor-parallel size)."""
        ...

    async def init_weight_group(self, group: WeightGroupSpec, rank_offset: int) -> None:
        """Join the group at `rank_offset`; returns once the whole group has formed."""
        ...

    async def begin_weight_update(self) -> None:
        """Open one update (before the first bucket)."""
        ...

    async def receive_weight_bucket(
        self, specs: Sequence[TensorSpecLike], *, version: str | None, flush_cache: bool
    ) -> None:
        """Receive one bucket (the trainer broadcasts it meanwhile) and load it."""
        ...

    async def finish_weight_update(self, version: str) -> None:
        """Close the update; afterwards the engine serves `version`."""
        ...

    async def abort_weight_update(self) -> None:
        """After a failed update: close the update without claiming a new version."""
        ...

    async def destroy_weight_group(self, group_name: str) -> None:
        """Leave the group."""
        ...
