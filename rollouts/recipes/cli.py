"""`rollouts init DIR [--recipe NAME] [--force]`: a packaged recipe and its data, written in DIR.

    rollouts init demo
    cd demo && rollouts train --mode sft+rl --config demo-cpu.toml

It writes DIR/NAME.toml (the recipe's text, unchanged) and runs the recipe's `data.prepare`
hook with the data paths under DIR, so the data files are there to read before training. A
config's relative paths resolve against the directory `rollouts train` runs in: the printed
command changes into DIR first, and the run directory and the model land under DIR too.
Files that exist are never overwritten without `--force`.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import tomllib
from pathlib import Path

from rollouts.config import Config, DataConfig, RunMode, config_from_dict
from rollouts.plugins import import_object
from rollouts.recipes import (
    DEFAULT_RECIPE,
    SUFFIX,
    recipe_names,
    recipe_summary,
    recipe_text,
)

DATA_KEYS = ("sft_path", "train_path", "eval_path")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InitPlan:
    """What `rollouts init` writes: the recipe's config in `out_dir`, and its data there."""

    recipe: str
    out_dir: Path
    config: Config  # the recipe as written (its paths relative to out_dir)
    data: DataConfig  # config.data with its relative paths under out_dir: what the hook is given
    mode: RunMode  # what the printed command trains

    @property
    def config_path(self) -> Path:
        """DIR/NAME.toml."""
        return self.out_dir / (self.recipe + SUFFIX)

    @property
    def data_files(self) -> list[Path]:
        """The data files the config names, under DIR."""
        return [Path(p) for p in (getattr(self.data, k) for k in DATA_KEYS) if p]


def plan_init(recipe: str, out_dir: str | Path) -> InitPlan:
    """Read recipe `recipe` (`UnknownRecipe`, `ConfigError`) and place it in `out_dir`."""
    text = recipe_text(recipe)
    config = config_from_dict(tomllib.loads(text), f"recipe {recipe}")
    out = Path(out_dir)
    for key, path in _relative_paths(config).items():
        assert not Path(path).is_absolute(), f"recipe {recipe}: {key} = {path!r} is absolute"
    rebased = {k: str(out / p) for k in DATA_KEYS if (p := getattr(config.data, k))}
    data = dataclasses.replace(config.data, **rebased)
    mode: RunMode = "sft+rl" if config.data.sft_path else "rl"
    return InitPlan(recipe=recipe, out_dir=out, config=config, data=data, mode=mode)


def _relative_paths(config: Config) -> dict[str, str]:
    """The paths of a recipe that `rollouts train` resolves against its directory (DIR)."""
    paths = {f"data.{k}": getattr(config.data, k) for k in DATA_KEYS}
    paths |= {"run.output_dir": config.run.output_dir, "model.path": config.model.path}
    return {k: p for k, p in paths.items() if p}


def write_init(plan: InitPlan, *, force: bool) -> list[Path]:
    """Write the config (`FileExistsError` naming it when it exists, unless `force`), then the
    data (the `data.prepare` hook). Data files that exist are kept, as the hook and
    `rollouts train` keep them, unless `force`; the kept ones are returned."""
    if plan.config_path.exists() and not force:
        raise FileExistsError(
            f"{plan.config_path} exists: pass --force to overwrite it, or choose another DIR"
        )
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    plan.config_path.write_text(recipe_text(plan.recipe), encoding="utf-8")
    if not plan.data.prepare:
        return []
    if force:
        for path in plan.data_files:
            path.unlink(missing_ok=True)
    before = {p: p.stat().st_mtime_ns for p in plan.data_files if p.is_file()}
    import_object(plan.data.prepare)(plan.data)
    missing = [str(p) for p in plan.data_files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data.prepare = {plan.data.prepare!r} did not write {missing}")
    return [p for p, mtime in before.items() if p.stat().st_mtime_ns == mtime]


def next_command(plan: InitPlan, shown_dir: str) -> str:
    """The command to run next, as typed in the directory `rollouts init` ran in."""
    train = f"rollouts train --mode {plan.mode} --config {shlex.quote(plan.config_path.name)}"
    if plan.out_dir.resolve() == Path.cwd().resolve():
        return train
    return f"cd {shlex.quote(shown_dir)} && {train}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts init`; the recipes are listed under --help."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    lines = [f"  {name:16} {recipe_summary(name)}" for name in recipe_names()]
    parser.epilog = "recipes:\n" + "\n".join(lines)
    parser.add_argument("dir", metavar="DIR", help="where to write (created when missing)")
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        metavar="NAME",
        help=f"the packaged recipe to write (default {DEFAULT_RECIPE}; listed below)",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite the config and data files that exist"
    )


def run(args: argparse.Namespace) -> int:
    """Write the recipe and its data in DIR; print what was written and the next command."""
    try:
        plan = plan_init(args.recipe, args.dir)
        kept = write_init(plan, force=args.force)
    except (ValueError, OSError) as e:  # UnknownRecipe, ConfigError, a hook's PluginError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[init] wrote {plan.config_path} (recipe {plan.recipe}: {recipe_summary(plan.recipe)})")
    _print_data(plan, kept)
    run_dir = plan.out_dir / plan.config.run.output_dir
    print(
        "[init] the config's relative paths resolve against the directory train runs in: "
        f"run it in {args.dir} (the run goes to {run_dir})"
    )
    print("[init] next:")
    print(f"    {next_command(plan, args.dir)}")
    return 0


def _print_data(plan: InitPlan, kept: list[Path]) -> None:
    written = ", ".join(str(p) for p in plan.data_files if p not in kept)
    if written:
        how = f"data.prepare = {plan.data.prepare}" if plan.data.prepare else "yours to write"
        print(f"[init] {'wrote' if plan.data.prepare else 'data:'} {written} ({how})")
    if kept:
        names = ", ".join(str(p) for p in kept)
        print(f"[init] kept {names}: they exist (--force writes them anew)")
