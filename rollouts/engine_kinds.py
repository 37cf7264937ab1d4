"""The engine kinds by name (`ENGINE_KINDS`): what the run must know of each kind of server.

An `EngineKind` is a record, as a policy loss is (`algorithms/policy_loss.py`): `engines.kind`
names one, and the config checks, the driver, the placement, the weight sync and its content
check ask it, never the name. Adding a kind: its client (a module of `rollouts/inference/` whose
class implements `InferenceEngine`) and one entry here; nothing else names a kind.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

LogprobsFrom = Literal["raw", "scaled"]  # of the raw logits | of the temperature-scaled ones
WeightWire = Literal["sglang", "vllm"]  # `weights/transport.py`: SGLang's group | vLLM's NCCL


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncWire:
    """How the distributed weight sync reaches a kind's servers (its client's `weight_wire`)."""

    name: WeightWire
    # why it needs NCCL from a trainer on CUDA; "" = gloo works too (the trainer on CPU)
    nccl_only: str = ""


SGLANG_WIRE = SyncWire(name="sglang")
VLLM_WIRE = SyncWire(
    name="vllm",
    nccl_only="vLLM has no CPU transfer backend: its CPU build (0.32) starts with "
    "--weight-transfer-config nccl but /init_weight_transfer_engine fails with 'Cannot access "
    "accelerator device when none is available.'",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineKind:
    """One kind of engine server: its client, and what the run does differently for it."""

    name: str
    # the client, `module.name` (a class or a function) called as (url, *, api_key=,
    # options=HttpOptions): it speaks the kind's routes (generation, pause, reload, sleep) and
    # its weight wire. A dotted path: the config, which checks the kind, is below the clients
    client: str
    # True: the run starts the servers itself ([engines.builtin]: `rollouts serve` processes on
    # this host); False: servers already up at `engines.urls`, anywhere
    started_here: bool
    # which logits its servers' sampled-token logprobs come from by default (`engine_logprobs`;
    # started here: `engines.builtin.logprobs_from` says)
    served_logprobs: LogprobsFrom
    raw_logprobs: str  # how to make its logprobs those of the raw logits (a config error's fix)
    sync_wire: SyncWire
    sleeps: bool = True  # it has sleep routes (`engines.sleep_level` needs them)

    def __post_init__(self) -> None:
        assert "." in self.client, f"{self.name}: client {self.client!r} is not module.name"
        assert self.raw_logprobs, f"{self.name}: say how its logprobs become raw ones"


ENGINE_KINDS: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind(
            name="builtin",
            client="rollouts.inference.sglang.SGLangEngine",  # it speaks SGLang's routes
            started_here=True,
            served_logprobs="raw",
            raw_logprobs="set engines.builtin.logprobs_from = 'raw'",
            sync_wire=SGLANG_WIRE,
        ),
        EngineKind(
            name="sglang",
            client="rollouts.inference.sglang.SGLangEngine",
            started_here=False,
            served_logprobs="scaled",  # log(softmax(logits / T)) unless told otherwise
            raw_logprobs="start the SGLang servers with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (their "
            "logprobs are then of the raw logits) and set engines.served_logprobs = 'raw'",
            sync_wire=SGLANG_WIRE,
        ),
        EngineKind(
            name="vllm",
            client="rollouts.inference.vllm.VLLMEngine",
            started_here=False,
            served_logprobs="raw",  # --logprobs-mode raw_logprobs, its default
            raw_logprobs="start the vLLM servers with --logprobs-mode raw_logprobs (vLLM's "
            "default) and set engines.served_logprobs = 'raw'",
            sync_wire=VLLM_WIRE,
        ),
    )
}


def engine_kind(name: str) -> EngineKind:
    """The kind `engines.kind` names (the config refused any other at load)."""
    assert name in ENGINE_KINDS, f"engine kind {name!r} not in {sorted(ENGINE_KINDS)}"
    return ENGINE_KINDS[name]
