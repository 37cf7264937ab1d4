"""`rollouts train` / `integration_training/train.py`: the front door.

    python integration_training/train.py --mode sft|rl|sft+rl --config configs/X.toml \
        [--set key=value ...] [--resume | --resume-step N] [--nproc N] [--debug]
        [--nnodes K --rdzv-endpoint HOST:PORT [--node-rank R]]
        [--rollout-only | --replay RUN_DIR]     (with --mode rl: driver/halves.py)

An operating error (bad data, a plugin that cannot load, a reward that always fails, a full
disk) prints its message alone; the traceback goes to the run directory's error.log (and to the
terminal with --debug).

With `--nproc N > 1` (or `training.nproc`) and no torchrun around it, the command re-launches
itself under `torchrun --nproc_per_node N` for the FSDP backend; with `--nnodes K` (run the same
command on every node) under a multi-node torchrun that meets at `--rdzv-endpoint`. Under
`srun`, Slurm's task variables stand for torchrun's (`driver/launch.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import typing
from pathlib import Path
from typing import NoReturn

from rollouts.config import Config, ConfigError, RLHalves, RunMode, load_config
from rollouts.driver.errors import report_error
from rollouts.driver.launch import needs_torchrun, srun_ranks, torchrun_command
from rollouts.driver.lock import RunInUse, hold_run_locks  # light: no torch before the lock
from rollouts.heap import keep_freed_memory

MODES = typing.get_args(RunMode)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts train` (and of train.py)."""
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--config", required=True, help="a TOML config, e.g. configs/demo-cpu.toml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set rollout.batch_size=4 (repeatable)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue each phase from its newest checkpoint (verified first: a corrupt one stops "
        "the run, see checkpoint.on_corrupt)",
    )
    parser.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="resume (implies --resume) from exactly step N of the phase being resumed",
    )
    parser.add_argument(
        "--nproc", type=int, default=0, help="processes per node (FSDP); 0 = config"
    )
    parser.add_argument("--nnodes", type=int, default=0, help="nodes (FSDP); 0 = config")
    parser.add_argument(
        "--rdzv-endpoint",
        default="",
        metavar="HOST:PORT",
        help="where the nodes' torchrun agents meet (an address of the first node)",
    )
    parser.add_argument(
        "--node-rank", type=int, default=-1, help="this node's rank; -1 = assigned at rendezvous"
    )
    halves = parser.add_mutually_exclusive_group()
    halves.add_argument(
        "--rollout-only",
        action="store_true",
        help="(--mode rl) generate and score training.rl_steps batches with the starting "
        "weights and store them in RUN/batches for a later --replay: no trainer, no weight sync",
    )
    halves.add_argument(
        "--replay",
        default=None,
        metavar="RUN_DIR",
        help="(--mode rl) train on the batches RUN_DIR stored (logging.save_batches or "
        "--rollout-only) with no engines: no generation, no weight sync, no evaluation",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print an error's full traceback (otherwise it goes to the run dir's error.log)",
    )


def run(args: argparse.Namespace) -> int:
    """Load the config, re-launch under torchrun if asked, take the run's locks, then import
    the training (torch, transformers) and run it."""
    keep_freed_memory()  # this process hosts the trainer in sync mode and under torchrun
    overrides = list(args.overrides)
    for key, value in (("nproc", args.nproc), ("nnodes", args.nnodes)):
        if value:
            overrides.append(f"training.{key}={value}")
    if args.rdzv_endpoint:
        overrides.append(f"training.rdzv_endpoint={args.rdzv_endpoint}")
    try:
        config = load_config(args.config, overrides)
        os.environ.update(srun_ranks(config, os.environ))  # srun's tasks as torchrun's ranks
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and config.training.backend != "fsdp":
            config = load_config(args.config, [*overrides, "training.backend=fsdp"])
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    refused = halves_problem(args, config)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    try:
        if needs_torchrun(config, os.environ):
            _relaunch(args, config)
        with _driver_locks(config):  # before torch: a second run is refused at once
            from rollouts.driver.run import run_training

            return run_training(
                args.mode,
                config,
                resume=args.resume or args.resume_step is not None,
                config_path=args.config,
                resume_step=args.resume_step,
                halves=halves_of(args),
                replay_dir=Path(args.replay) if args.replay else None,
            )
    except Exception as e:  # an operating error: its message alone (see driver/errors.py)
        run_dir = Path(config.run.output_dir) if config.run.output_dir else None
        if isinstance(e, RunInUse):  # the directory is the other run's: its error.log too
            run_dir = None
        return report_error(e, run_dir, debug=args.debug)


def halves_of(args: argparse.Namespace) -> RLHalves:
    """Which halves of the RL phase the command runs (`--rollout-only`, `--replay`)."""
    if args.rollout_only:
        return "rollout-only"
    return "replay" if args.replay else "both"


def halves_problem(args: argparse.Namespace, config: Config) -> str:
    """Why `--rollout-only` / `--replay` cannot run as asked ("" when they can), before any
    heavy import: the flag and the fix."""
    halves = halves_of(args)
    flag = "--rollout-only" if halves == "rollout-only" else "--replay"
    if halves != "both" and args.mode != "rl":
        return (
            f"{flag} runs the RL phase alone: use --mode rl (to start from an SFT model: "
            "--set model.path=RUN/checkpoints/sft/step_NNNNNN/model)"
        )
    if halves == "rollout-only" and (args.resume or args.resume_step is not None):
        return (
            "--rollout-only keeps no checkpoint to resume: run it again (it rewrites its batches)"
        )
    if halves != "replay":
        return ""
    replay = Path(args.replay).resolve()
    if not replay.is_dir():
        return f"--replay {args.replay}: no such run directory"
    if config.run.output_dir and Path(config.run.output_dir).resolve() == replay:
        return (
            f"--replay {args.replay} is this run's own run.output_dir: replay into another one "
            "(--set run.output_dir=...)"
        )
    return ""


def _driver_locks(config: Config) -> contextlib.AbstractContextManager[object]:
    """The run's locks (`lock.hold_run_locks`) in the process that runs the driver: global rank
    0, or the only process; the other ranks take none."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return hold_run_locks(config)


def _relaunch(args: argparse.Namespace, config: Config) -> NoReturn:
    """Re-run the command under torchrun. On one node, first check that no live run holds the
    directory (the locks are taken and given back; rank 0 takes them for the run), so a second
    run is refused before torchrun and its ranks import torch; across nodes only rank 0, on
    whichever node, may take them."""
    if config.training.nnodes == 1:
        with hold_run_locks(config, bases=[]):
            pass
    cmd = torchrun_command(args, config)
    print(f"[train] re-launching under torchrun: {' '.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)


def main(argv: list[str] | None = None) -> int:
    """Entry point of integration_training/train.py."""
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
