"""How train.py becomes several trainer processes: on one node, on several, or under Slurm.

- One node: `--nproc N` (or `training.nproc`) re-runs the command under
  `torchrun --standalone --nproc_per_node N`.
- Several nodes: `--nnodes K --rdzv-endpoint HOST:PORT` (or `training.nnodes`,
  `training.rdzv_endpoint`), the same command on every node, re-runs it under
  `torchrun --nnodes K --nproc_per_node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`; the
  agents meet at the endpoint and number the ranks. Started by torchrun yourself works too.
- Slurm, two ways. One task per node with `--nproc`/`--nnodes` as above: each task runs
  torchrun. Or one task per trainer process with nproc = nnodes = 1 (`srun_ranks`): the step's
  variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE,
  SLURM_NODEID) become torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), with
  MASTER_ADDR and MASTER_PORT from the batch script.

Whatever started them, global rank 0 runs the driver (engines, rollouts, checkpoints' own files)
and every rank trains its shard (`trainer/mirror.py`); LOCAL_RANK picks the GPU and
LOCAL_WORLD_SIZE shares this node's cores (`local_world_size`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from rollouts.config import Config
from rollouts.forkserver.client import ENV_VAR as FORKSERVER_VAR
from rollouts.forkserver.client import PROXY

SLURM_GUIDE = "docs/scaling.md"


def torchrun_command(args: argparse.Namespace, config: Config) -> list[str]:
    """The command that re-runs this invocation under torchrun: one node (`--standalone`) or
    several (c10d rendezvous at `training.rdzv_endpoint`).

    It runs `-m rollouts.cli train`, so train.py and the `rollouts train` console script both
    re-launch the same way; the ranks get the resolved process counts and the FSDP backend.
    Where a forkserver runs (`$ROLLOUTS_FORKSERVER`, the test suite's), each rank is forked by it
    behind `rollouts.forkserver.proxy`, which torchrun holds as the rank's process.
    """
    t = config.training
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, f"--nproc_per_node={t.nproc}"]
    if t.nnodes == 1:
        cmd.insert(1, "--standalone")
    else:
        cmd += [f"--nnodes={t.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={t.rdzv_endpoint}"]
        cmd.append(f"--rdzv-id={config.run.name}")
        if args.node_rank >= 0:
            cmd.append(f"--node-rank={args.node_rank}")
    if os.environ.get(FORKSERVER_VAR):  # each rank forked by the forkserver (the test suite's)
        cmd += PROXY
    cmd += ["-m", "rollouts.cli", "train", "--mode", args.mode, "--config", args.config]
    for override in args.overrides:
        cmd += ["--set", override]
    cmd += ["--set", f"training.nproc={t.nproc}", "--set", f"training.nnodes={t.nnodes}"]
    if t.nnodes > 1:
        cmd += ["--set", f"training.rdzv_endpoint={t.rdzv_endpoint}"]
    cmd += ["--set", "training.backend=fsdp"]
    if args.resume:
        cmd.append("--resume")
    if args.resume_step is not None:
        cmd += ["--resume-step", str(args.resume_step)]
    if args.debug:
        cmd.append("--debug")
    if args.rollout_only:
        cmd.append("--rollout-only")
    if args.replay:
        cmd += ["--replay", str(Path(args.replay).resolve())]
    return cmd


def needs_torchrun(config: Config, environ: Mapping[str, str]) -> bool:
    """Several trainer processes asked for, and nothing (torchrun, srun) started them yet."""
    t = config.training
    return t.nproc * t.nnodes > 1 and "LOCAL_RANK" not in environ


def srun_ranks(config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """`slurm_ranks` when srun's tasks are the ranks: the config asks for one process
    (nproc = nnodes = 1); with more, each task runs torchrun (`torchrun_command`) instead."""
    t = config.training
    return slurm_ranks(environ) if t.nproc * t.nnodes == 1 else {}


def slurm_ranks(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's rank variables for a process of an `srun` step with several tasks; {} when
    torchrun set them already, outside an srun step, or for one task. (A batch script's own
    shell has SLURM_NTASKS but no SLURM_STEP_NUM_TASKS: it is not a rank.)"""
    if "RANK" in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}
    world = int(environ["SLURM_STEP_NUM_TASKS"])
    if world <= 1:
        return {}
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
    if missing:
        raise ValueError(
            f"srun started {world} tasks but {' and '.join(missing)} is not set: export "
            "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) and "
            f"MASTER_PORT=29500 in the batch script ({SLURM_GUIDE})"
        )
    per_node = tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    node = int(environ["SLURM_NODEID"])
    assert 0 <= node < len(per_node), f"{node=} outside {per_node=}"
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "GROUP_RANK": str(node),
    }


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed list, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE = {spec!r}: cannot read {part!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def local_world_size(environ: Mapping[str, str]) -> int:
    """Trainer processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(environ.get("LOCAL_WORLD_SIZE", "1"))


def shares_node_with_driver(environ: Mapping[str, str]) -> bool:
    """Whether this process runs on the node of global rank 0 (the driver and its built-in
    engines): the ranks of a node are consecutive, so its first is RANK - LOCAL_RANK."""
    return int(environ.get("RANK", "0")) - int(environ.get("LOCAL_RANK", "0")) == 0
