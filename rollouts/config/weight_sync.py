"""[weight_sync] section: how the trainer's weights reach the engines."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rollouts.config.base import _check, _Section

SyncMethod = Literal["disk", "distributed"]
SyncBackend = Literal["auto", "gloo", "nccl"]  # auto: nccl on cuda, else gloo


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig(_Section):
    """[weight_sync]: "disk" (HF safetensors in /dev/shm, reloaded by path) or "distributed"
    (broadcast over a process group the trainer forms with the engines: gloo on CPU, NCCL on
    GPU; SGLang's protocol for SGLang and the built-in engine, vLLM's weight transfer for vLLM).
    """

    KEY: ClassVar[str] = "weight_sync"

    method: SyncMethod = "disk"
    bucket_mb: float = 256.0  # tensors per broadcast: one HTTP call + one collective per bucket
    master_address: str = "127.0.0.1"  # the trainer's address as the engines reach it
    master_port: int = 0  # 0 = a free port, picked each time the group forms
    backend: SyncBackend = "auto"
    group_name: str = "rollouts_weights"
    timeout_s: float = 300.0  # forming the group, and one whole sync
    # after each sync (and at start) every engine's logprobs of a fixed probe sequence must
    # match the trainer's: a version label proves nothing (weight_check.py)
    check: bool = True
    check_tokens: int = 32  # the probe's length
    check_tolerance: float = 0.0  # largest |engine - trainer| logprob; 0 = by model.dtype

    def problems(self) -> list[str]:
        p: list[str] = []
        _check(p, self.bucket_mb > 0, f"weight_sync.bucket_mb = {self.bucket_mb}: must be > 0")
        _check(
            p,
            0 <= self.master_port < 65536,
            f"weight_sync.master_port = {self.master_port}: must be in [0, 65535] (0 = free port)",
        )
        _check(p, bool(self.master_address), "weight_sync.master_address: must not be empty")
        _check(p, bool(self.group_name), "weight_sync.group_name: must not be empty")
        _check(p, self.timeout_s > 0, f"weight_sync.timeout_s = {self.timeout_s}: must be > 0")
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
