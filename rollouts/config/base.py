"""Shared pieces of the config sections: `ConfigError`, the check helpers, `_Section`.

A mode is a `typing.Literal` field; `literal_problem` is its one check, run by the loader on a
TOML value (naming the key path where it was read) and by `_Section` on a section built in code.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, ClassVar


class ConfigError(ValueError):
    """One or more problems in a configuration, each naming its key path and the fix."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} config problem(s){where}:\n{lines}")


def _check(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def _not_one_of(key: str, value: Any, allowed: tuple[Any, ...]) -> str:
    names = [a for a in allowed if isinstance(a, str)]
    close = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key} = {value!r}: must be one of {list(allowed)}{hint}"


def _one_of(problems: list[str], key: str, value: str, allowed: tuple[str, ...]) -> None:
    """For a value set known only at run time (a registry); a fixed set is a `Literal` field."""
    _check(problems, value in allowed, _not_one_of(key, value, allowed))


def config_fields(cls: Any) -> list[dataclasses.Field]:
    """The fields of section `cls` that are config keys: all but those a run sets itself
    (metadata `config_key` false: the built-in engine's model, port ... `EngineOptions`)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("config_key", True)]


def is_literal(tp: Any) -> bool:
    """Whether the annotation `tp` is a mode: `Literal[...]`."""
    return typing.get_origin(tp) is typing.Literal


def literal_problem(key: str, value: Any, tp: Any) -> str | None:
    """The check of a mode field: None when `value` is one of the `Literal` type `tp`'s values,
    else the problem, naming the key and every value allowed."""
    assert is_literal(tp), f"{key}: {tp} is not a Literal"
    allowed = typing.get_args(tp)
    ok = any(type(value) is type(a) and value == a for a in allowed)  # True is not 1
    return None if ok else _not_one_of(key, value, allowed)


@functools.cache
def _mode_fields(cls: type[_Section]) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    modes = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    modes = tuple((name, tp) for name, tp in modes if is_literal(tp))
    assert cls.KEY or not modes, f"{cls.__name__}.KEY is empty: its mode problems need the path"
    return modes


class _Section:
    """Mixin: check the mode fields and run `problems()` at construction, so no invalid section
    can exist. `KEY` is the section's path in the TOML ("rollout.sampling")."""

    KEY: ClassVar[str] = ""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        found = [
            problem
            for name, tp in _mode_fields(type(self))
            if (problem := literal_problem(f"{self.KEY}.{name}", getattr(self, name), tp))
        ]
        found += self.problems()
        if found:
            raise ConfigError(found)
