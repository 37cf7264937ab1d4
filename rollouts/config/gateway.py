"""[rollout.gateway]: the OpenAI-compatible gateway in front of the engines (rollouts/gateway/).

Read when `rollout.generate_fn` names the gateway's generate function: each sample's agent (a
user function, `agent`) gets a per-sample `base_url` and calls `/v1/chat/completions` there.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from rollouts.config.base import _check, _Section

GATEWAY_GENERATE_FN = "rollouts.gateway.agent_generate"  # rollout.generate_fn of the gateway


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GatewayConfig(_Section):
    """[rollout.gateway]: the agent behind the gateway and the bounds of its episodes."""

    KEY: ClassVar[str] = "rollout.gateway"

    # dotted path of `agent(base_url, prompt, metadata) -> str` (async or sync), e.g.
    # "examples.openai_agent.solve"; "" = no gateway
    agent: str = ""
    max_calls: int = 8  # chat completions per episode; one more is refused (sample TRUNCATED)
    call_timeout_s: float = 120.0  # one chat completion, engine time included

    def problems(self) -> list[str]:
        p: list[str] = []
        key = self.KEY
        _check(p, self.max_calls >= 1, f"{key}.max_calls = {self.max_calls}: must be >= 1")
        _check(
            p, self.call_timeout_s > 0, f"{key}.call_timeout_s = {self.call_timeout_s}: must be > 0"
        )
        return p


def gateway_problems(generate_fn: str, gateway: GatewayConfig) -> list[str]:
    """The gateway's generate function and its agent come together, or not at all."""
    p: list[str] = []
    uses = generate_fn == GATEWAY_GENERATE_FN
    _check(
        p,
        not uses or bool(gateway.agent),
        f'rollout.gateway.agent = "": rollout.generate_fn = "{GATEWAY_GENERATE_FN}" needs the '
        'agent it serves, e.g. agent = "examples.openai_agent.solve"',
    )
    _check(
        p,
        uses or not gateway.agent,
        f"rollout.gateway.agent = {gateway.agent!r} is read only with rollout.generate_fn = "
        f'"{GATEWAY_GENERATE_FN}" (now {generate_fn!r}): set it, or remove the agent',
    )
    return p
