"""The Environment Protocol: what a multi-turn agent loop steps through.

An environment answers the model's actions with observations. It never computes rewards: those
are computed after collection, over the whole group, by the reward function (which can read what
the environment left in `Sample.metadata["env_info"]`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rollouts.types import Sample

if TYPE_CHECKING:
    from rollouts.envs.tool_format import ToolSpec

# info keys an environment may set that the agent loop understands
ROLE_KEY = "role"  # role of the observation message ("user" by default, "tool" for tool output)
# per-step signals an environment may report; rollouts.rewards.trajectory turns them into rewards
STEP_REWARD_KEY = "step_reward"  # float: reward earned by this step's action
SUCCESS_KEY = "success"  # bool: the episode's goal is reached
INVALID_ACTION_KEY = "invalid_action"  # bool: this step's action was invalid


@runtime_checkable
class Environment(Protocol):
    """A stateful episode. `reset` starts it; `step` takes the model's text and answers.

    `reset()` returns the first observation ("" = none: the prompt alone starts the episode).
    `step(action)` returns `(observation, done, info)`; `observation` is appended to the
    conversation (role `info.get("role", "user")`) unless `done` and it is empty.
    `step` may instead return an awaitable of that tuple (an environment that awaits I/O, e.g. a
    model-played user); the agent loop awaits it.
    """

    def reset(self) -> str: ...

    def step(self, action: str) -> tuple[str, bool, Mapping[str, Any]]: ...


@runtime_checkable
class DescribesTools(Protocol):
    """An environment whose tools the model is told about: the agent loop puts `tool_specs`
    before the model the way its chat template allows (`envs/tool_format.with_tools`)."""

    @property
    def tool_specs(self) -> Sequence[ToolSpec]: ...


EnvFactory = Callable[[Sample], Environment]
"""Builds a fresh environment for one sample (it may read `sample.prompt` and `sample.label`)."""
