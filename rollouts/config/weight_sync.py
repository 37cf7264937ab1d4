"""[weight_sync] section (with [weight_sync.distributed]): how and when the trainer's weights
reach the engines."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

SyncMethod = Literal["disk", "distributed"]
SyncBackend = Literal["auto", "gloo", "nccl"]  # auto: nccl on cuda, else gloo
# with model.lora: "adapter" = only the adapter (engines load it by name); "merged" = the full
# weights with the adapter merged in (engines without adapter routes)
LoraSync = Literal["adapter", "merged"]
# the dtype of the weight files written for the engines; "auto" = the built-in engines' dtype
# when it is 16-bit, else the trained dtype
SyncDtype = Literal["auto", "float32", "bfloat16", "float16"]
# async mode: what a weight load does to the requests in flight (sync mode has none: it aborts)
InFlight = Literal["wait", "keep"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistributedSyncConfig(_Section):
    """[weight_sync.distributed]: the process group of method = "distributed" (read only then)."""

    KEY: ClassVar[str] = "weight_sync.distributed"

    backend: SyncBackend = "auto"
    bucket_mb: float = 256.0  # tensors per broadcast: one HTTP call + one collective per bucket
    # the trainer's address as the engines reach it; "" = automatic: 127.0.0.1 while every
    # engine is on this host, else this host's address towards the first remote engine
    # (weights/reach.py; the start-up line says which)
    master_address: str = ""
    master_port: int = 0  # 0 = a free port, picked each time the group forms
    group_name: str = "rollouts_weights"
    timeout_s: float = 300.0  # forming the group, and one whole sync

    def problems(self) -> list[str]:
        p: list[str] = []
        key = self.KEY
        _check(p, self.bucket_mb > 0, f"{key}.bucket_mb = {self.bucket_mb}: must be > 0")
        _check(
            p,
            0 <= self.master_port < 65536,
            f"{key}.master_port = {self.master_port}: must be in [0, 65535] (0 = free port)",
        )
        _check(p, bool(self.group_name), f"{key}.group_name: must not be empty")
        _check(p, self.timeout_s > 0, f"{key}.timeout_s = {self.timeout_s}: must be > 0")
        return p


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig(_Section):
    """[weight_sync]: "disk" (HF safetensors in /dev/shm, reloaded by path) or "distributed"
    (broadcast over a process group the trainer forms with the engines: gloo on CPU, NCCL on
    GPU; SGLang's protocol for SGLang and the built-in engine, vLLM's weight transfer for vLLM).
    """

    KEY: ClassVar[str] = "weight_sync"

    method: SyncMethod = "disk"
    every: int = 1  # RL steps per sync
    # weights-only copies for the engines (the disk sync's files; with either method, the
    # starting weights of external servers); "" = /dev/shm (else a temp dir)
    dir: str = ""
    attempts: int = 3  # disk: tries per engine before a sync fails
    # after each sync (and at start) every engine's logprobs of a fixed probe sequence must
    # match the trainer's: a version label proves nothing (weights/check.py)
    check: bool = True
    check_tokens: int = 32  # the probe's length
    check_tolerance: float = 0.0  # |engine - trainer| logprob: largest (fp32) or mean; 0 = by dtype
    lora: LoraSync = "adapter"  # read only with model.lora.enabled
    # the weight files for the engines in this dtype (an engine casts to its own on load, so
    # writing its 16-bit dtype gives it the same weights in half the bytes): "auto" = the
    # built-in engines' dtype when it is 16-bit, else as trained
    dtype: SyncDtype = "auto"
    # async mode, a load while requests run: "wait": it waits until they finish (the producer
    # starts no batch meanwhile), so every sample comes from one weight version; "keep": they
    # go on under the new weights, their KV cache rebuilt (the built-in engine and SGLang prefill
    # every running row again; vLLM keeps its cache). A sample's staleness counts its oldest
    # version either way. Case A (scripts/bench_trl.py): an async step 0.74-0.82 s with "wait"
    # against 0.93-0.98 s with "keep", whose prefill took 0.17 s of each batch's 0.7 s
    in_flight: InFlight = "wait"
    distributed: DistributedSyncConfig = dataclasses.field(default_factory=DistributedSyncConfig)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.every >= 1, f"weight_sync.every = {self.every}: must be >= 1")
        _check(p, self.attempts >= 1, f"weight_sync.attempts = {self.attempts}: must be >= 1")
        _check(
            p,
            self.check_tokens >= 2,
            f"weight_sync.check_tokens = {self.check_tokens}: must be >= 2",
        )
        _check(
            p,
            self.check_tolerance >= 0,
            f"weight_sync.check_tolerance = {self.check_tolerance}: must be >= 0 (0 = by dtype)",
        )
        return p
