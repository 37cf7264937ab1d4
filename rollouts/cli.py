"""The `rollouts` command: `init`, `make-tiny-model`, `models`, `serve`, `train`, `plot`, `show`.

Each subcommand lives in its own module and is imported only when asked for, so
`rollouts make-tiny-model` does not pay for importing the server or the trainer.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rollouts.openmp import short_spin_waits

# subcommand -> (module, help). The module has `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS = {
    "init": ("rollouts.recipes.cli", "write a packaged recipe (config + data) in DIR"),
    "make-tiny-model": ("rollouts.models.cli", "build a tiny local model + tokenizer in DIR"),
    "models": (
        "rollouts.models.fetch_cli",
        "real models: fetch NAME [DIR], list, merge ADAPTER OUT",
    ),
    "serve": ("rollouts.engine.cli", "run the built-in engine server"),
    "train": ("rollouts.driver.cli", "train: --mode sft|rl|sft+rl --config X.toml"),
    "plot": ("rollouts.driver.plot", "write PNG plots of a run's metrics.jsonl"),
    "show": ("rollouts.driver.show", "a run at a glance: steps, phase times, slow samples"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand, import its module, and run it."""
    short_spin_waits()  # before the subcommand's module loads torch
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rollouts", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
