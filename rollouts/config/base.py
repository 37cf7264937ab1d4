"""Shared pieces of the config sections: `ConfigError`, the check helpers, `_Section`."""

from __future__ import annotations


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


def _one_of(problems: list[str], key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(problems, value in allowed, f"{key} = {value!r}: must be one of {list(allowed)}")


class _Section:
    """Mixin: run `problems()` at construction, so no invalid section can exist."""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ConfigError(found)
