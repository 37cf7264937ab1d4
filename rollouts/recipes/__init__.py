"""Recipes: the ready configs that travel inside the wheel (`rollouts init DIR --recipe NAME`).

Each recipe is a TOML file of this package (package data in pyproject.toml). The checkout's
`configs/demo-cpu.toml` and its siblings are git symlinks to these files, so the README's
commands and an installed wheel read one text. A recipe's relative paths (data, run directory,
model) resolve against the directory `rollouts train` runs in, as for every config.
"""

from __future__ import annotations

from importlib import resources

SUFFIX = ".toml"
DEFAULT_RECIPE = "demo-cpu"


class UnknownRecipe(ValueError):
    """A recipe name that is not packaged; the message lists the known ones."""


def recipe_names() -> list[str]:
    """The names of the packaged recipes, sorted (`demo-cpu`, ...)."""
    files = resources.files(__name__).iterdir()
    names = sorted(f.name.removesuffix(SUFFIX) for f in files if f.name.endswith(SUFFIX))
    assert DEFAULT_RECIPE in names, f"{DEFAULT_RECIPE=} is not packaged: {names}"
    return names


def recipe_text(name: str) -> str:
    """The TOML text of recipe `name`; `UnknownRecipe` naming the known recipes otherwise."""
    known = recipe_names()
    if name not in known:
        raise UnknownRecipe(f"no recipe named {name!r}; the recipes are: {', '.join(known)}")
    return resources.files(__name__).joinpath(name + SUFFIX).read_text(encoding="utf-8")


def recipe_summary(name: str) -> str:
    """The first line of recipe `name`'s header comment: what it trains, for `--help`."""
    first = recipe_text(name).splitlines()[0]
    assert first.startswith("#"), f"recipe {name!r} starts without its header comment: {first!r}"
    return first.lstrip("# ").rstrip(".")
