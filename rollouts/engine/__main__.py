"""`python -m rollouts.engine --model DIR ...` (same as `rollouts serve`)."""

from __future__ import annotations

import argparse

from rollouts.engine.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m rollouts.engine")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
