"""[rollout.gateway] and the agent's start-up check."""

from __future__ import annotations

import pytest

from rollouts.config import ConfigError, RolloutConfig
from rollouts.config.gateway import GATEWAY_GENERATE_FN, GatewayConfig
from rollouts.gateway import open_agent_generate
from rollouts.plugins import PluginError


def test_the_gateway_and_its_agent_come_together() -> None:
    with pytest.raises(ConfigError, match=r"rollout.gateway.agent = \"\": rollout.generate_fn"):
        RolloutConfig(generate_fn=GATEWAY_GENERATE_FN)
    with pytest.raises(ConfigError, match="is read only with rollout.generate_fn"):
        RolloutConfig(gateway=GatewayConfig(agent="examples.openai_agent.solve"))
    with pytest.raises(ConfigError, match="rollout.gateway.max_calls = 0: must be >= 1"):
        GatewayConfig(max_calls=0)


def two_params(base_url: str, prompt: str) -> str:
    return ""


async def test_an_agent_with_the_wrong_signature_fails_at_start_up() -> None:
    config = RolloutConfig(
        generate_fn=GATEWAY_GENERATE_FN,
        gateway=GatewayConfig(agent=f"{__name__}.two_params"),
    )
    with pytest.raises(PluginError, match=r"two_params\(base_url, prompt\): takes 2"):
        async with open_agent_generate(config):
            pass
    async with open_agent_generate(RolloutConfig()) as nothing:
        assert nothing is None  # no gateway asked for: no server
