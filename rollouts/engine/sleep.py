"""Sleep and wake-up of the built-in engine: memory released while a colocated trainer trains.

What vLLM's dev-mode `/sleep?level=` and `/wake_up?tags=` do (and SGLang's
`/release_memory_occupation` / `/resume_memory_occupation`, which take the same tags):

- level 0: scheduling is held (the tag "scheduling"); requests are taken and wait.
- level 1: also the tags "weights" and "kv_cache": the weights move to host memory (on an
  accelerator; on CPU they are there already) and the KV cache of finished work is dropped.
- level 2: the weights are discarded. A wake-up brings them back as zeros, and nothing is
  served (generation, prompt logprobs) until a reload: vLLM serves whatever is in memory then,
  the built-in engine refuses instead of answering from zeros.

Generation waits until every tag is awake again; a reload needs the weights awake.
Used by the worker thread only (the routes go through `ServerState.command`).
"""

from __future__ import annotations

import dataclasses

import torch

from rollouts.heap import give_back_heap

TAGS = ("weights", "kv_cache", "scheduling")


class AsleepError(RuntimeError):
    """An operation the sleeping engine cannot do now: HTTP 503 (its message says which wake-up
    or reload it needs)."""


@dataclasses.dataclass(slots=True)
class SleepState:
    """Which memory is released, and what comes back on wake-up."""

    tags: set[str] = dataclasses.field(default_factory=set)
    weights_lost: bool = False  # a level-2 sleep discarded them: a reload must come first
    device: torch.device | None = None  # where the weights live when awake (while offloaded)
    # level 2: each discarded parameter's shape and dtype, by name
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=dict)

    @property
    def asleep(self) -> bool:
        return bool(self.tags)

    def check_resident(self, doing: str) -> None:
        """AsleepError unless the weights are in place (awake, possibly still to be reloaded)."""
        if "weights" in self.tags:
            raise AsleepError(f"cannot {doing}: the weights are asleep (POST /wake_up first)")

    def check_servable(self, doing: str) -> None:
        """AsleepError unless the weights in place are real ones."""
        self.check_resident(doing)
        if self.weights_lost:
            raise AsleepError(
                f"cannot {doing}: a level-2 sleep discarded the weights; reload them first"
            )

    def offload(self, model: torch.nn.Module) -> None:
        """Level 1: the weights to host memory (a no-op on CPU)."""
        device = next(model.parameters()).device
        if device.type != "cpu":
            self.device = device
            model.to("cpu")

    @torch.no_grad()
    def discard(self, model: torch.nn.Module) -> None:
        """Level 2: free every parameter's storage (tied ones are one parameter)."""
        device = next(model.parameters()).device
        self.device = device
        for name, param in model.named_parameters():
            self.shapes[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=device)
        self.weights_lost = True  # the caller gives a CPU's freed pages back (`release`)

    @torch.no_grad()
    def restore(self, model: torch.nn.Module, device: torch.device) -> None:
        """The weights back on `device`: moved back (level 1) or zeros to reload into (level 2)."""
        for name, param in model.named_parameters():
            if name in self.shapes:
                shape, dtype = self.shapes.pop(name)
                param.data = torch.zeros(shape, dtype=dtype, device=device)
        self.shapes.clear()
        if next(model.parameters()).device != device:
            model.to(device)
        self.device = None


def give_back_freed(device: torch.device) -> None:
    """What a release freed (weights, KV cache) back: torch's cached GPU blocks, or on CPU the
    heap's free pages (the server keeps freed pages for reuse, `rollouts/heap.py`)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        give_back_heap()


def gpu_gib(device: torch.device) -> float | None:
    """GiB reserved by torch's allocator on `device` (None off CUDA)."""
    return torch.cuda.memory_reserved(device) / 2**30 if device.type == "cuda" else None


def gpu_change(device: torch.device, before: float | None) -> str:
    """': X GiB reserved on cuda:N (was Y GiB)' after a `gpu_gib` reading, else ''."""
    if before is None or (now := gpu_gib(device)) is None:
        return ""
    return f": {now:.2f} GiB reserved on {device} (was {before:.2f} GiB)"
