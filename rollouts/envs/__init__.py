"""Environments for multi-turn rollouts: the Protocol, built-in environments, tool calls."""

from __future__ import annotations

from collections.abc import Callable

from rollouts.envs.builtin import (
    SingleTurnEnvironment,
    ToolEnvironment,
    calculator_env,
    self_verify_env,
)
from rollouts.envs.conversation import (
    ConversationEnvironment,
    ModelUser,
    UserReply,
    conversation_env,
)
from rollouts.envs.protocol import EnvFactory, Environment
from rollouts.envs.text_game import TextGameEnvironment
from rollouts.envs.tools import Tool, ToolCall, parse_tool_calls


def builtin_env_names() -> tuple[str, ...]:
    """Names accepted by `resolve_env_factory` besides dotted paths."""
    return ("single_turn", "calculator", "self_verify", "text_game")


def resolve_env_factory(name_or_path: str | Callable[..., Environment]) -> EnvFactory:
    """A built-in env name, a dotted path to a factory `(sample) -> Environment`, or one."""
    from rollouts.plugins import import_object  # local: plugins is light, avoids a cycle

    builtin: dict[str, EnvFactory] = {
        "single_turn": SingleTurnEnvironment,
        "calculator": calculator_env,
        "self_verify": self_verify_env,
        "text_game": TextGameEnvironment,
    }
    if callable(name_or_path):
        return name_or_path
    if name_or_path in builtin:
        return builtin[name_or_path]
    factory = import_object(name_or_path)
    if not callable(factory):
        raise ValueError(
            f"rollout.env = {name_or_path!r}: is not callable; names: "
            f"{list(builtin)} or a dotted path to (sample) -> Environment"
        )
    return factory


__all__ = [
    "ConversationEnvironment",
    "EnvFactory",
    "Environment",
    "ModelUser",
    "SingleTurnEnvironment",
    "TextGameEnvironment",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "UserReply",
    "builtin_env_names",
    "calculator_env",
    "conversation_env",
    "parse_tool_calls",
    "resolve_env_factory",
    "self_verify_env",
]
