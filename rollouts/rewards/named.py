"""Short names of built-in reward functions (`rollout.reward_fn = "math"`), and the one loader of
`rollout.reward_fn`: a short name, a dotted path or a function, checked against `RewardFn`.

A short name whose function needs an optional package says so when it is loaded, before anything
starts: `pip install 'rollouts[math]'`. `"judge"` is no function: the driver asks the [judge]
model (`rollouts/rollout/judge.py`) once its engines are up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

from rollouts.config.loader import JUDGE_REWARD
from rollouts.plugins import PluginError, load_function
from rollouts.rewards.protocol import RewardFn


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NamedReward:
    """A built-in reward function: its dotted path and the optional package it needs."""

    path: str
    needs: str = ""  # a module that must be importable ("" = none)
    extra: str = ""  # the extra of pyproject.toml that installs it

    def __post_init__(self) -> None:
        assert ":" in self.path, f"{self.path=}: expected 'package.module:function'"
        assert bool(self.needs) == bool(self.extra), f"{self.needs=} needs an extra: {self.extra=}"


NAMED_REWARDS: dict[str, NamedReward] = {
    "math": NamedReward(
        path="rollouts.rewards.math_answer:math_reward", needs="math_verify", extra="math"
    ),
}


class MissingExtra(ImportError):
    """An optional package a built-in function needs is not installed."""


def require_module(module: str, extra: str) -> None:
    """Raise `MissingExtra` naming the pip command unless `module` can be imported."""
    assert module and extra, f"{module=} {extra=}"
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{module} is not installed: pip install 'rollouts[{extra}]'")


def reward_path(spec: str) -> str:
    """The dotted path `spec` names: a short name's (`NAMED_REWARDS`), or `spec` itself when it
    is a dotted path; a built-in function's optional package is checked either way."""
    named = NAMED_REWARDS.get(spec)
    if named is None and "." not in spec and ":" not in spec:
        hint = (
            "the driver asks the [judge] for it; it is no function to load here"
            if spec == JUDGE_REWARD
            else f"or {JUDGE_REWARD!r} with a [judge]"
        )
        raise PluginError(
            f"rollout.reward_fn = {spec!r}: not a known reward name ({sorted(NAMED_REWARDS)}) "
            f"nor a dotted path like 'my_pkg.rewards:score'; {hint}"
        )
    path = named.path if named is not None else spec
    for builtin in NAMED_REWARDS.values():
        if builtin.path == path and builtin.needs:
            try:
                require_module(builtin.needs, builtin.extra)
            except MissingExtra as e:
                raise MissingExtra(f"rollout.reward_fn = {spec!r}: {e}") from None
    return path


def load_reward_fn(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The reward function `spec` names (a short name or dotted path) or is, its signature
    checked against `RewardFn`."""
    assert spec, "an empty reward function spec"
    return load_function(reward_path(spec) if isinstance(spec, str) else spec, RewardFn)
