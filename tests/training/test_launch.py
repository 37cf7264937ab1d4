"""How train.py becomes several trainer processes (driver/launch.py): the torchrun command for
one node and for several, Slurm's task variables as torchrun's, each node's share of the cores,
and the refusal of a checkpoint directory that not every rank sees (trainer/mirror.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rollouts.config import ConfigError, config_from_dict
from rollouts.driver.cli import add_arguments
from rollouts.driver.launch import (
    local_world_size,
    needs_torchrun,
    shares_node_with_driver,
    slurm_ranks,
    srun_ranks,
    tasks_per_node,
    torchrun_command,
)
from rollouts.forkserver import ENV_VAR
from rollouts.trainer.mirror import unshared_problem


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--mode", "sft", "--config", "c.toml", *argv])


def _training(**training: object) -> object:
    return config_from_dict({"run": {"name": "demo"}, "training": training})


@pytest.fixture(autouse=True)
def _no_forkserver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands as a user's run makes them (the suite's forkserver puts a proxy first)."""
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_one_node_stays_standalone() -> None:
    cmd = torchrun_command(_args("--nproc", "2"), _training(nproc=2))
    assert cmd[1:3] == ["--standalone", "--nproc_per_node=2"]
    assert not any(c.startswith("--nnodes") or c.startswith("--rdzv") for c in cmd)
    assert cmd[cmd.index("-m") + 1 :][:2] == ["rollouts.cli", "train"]
    assert "training.backend=fsdp" in cmd


def test_under_a_forkserver_each_rank_is_forked_behind_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = torchrun_command(_args("--nproc", "2"), _training(nproc=2))
    monkeypatch.setenv(ENV_VAR, "/tmp/some.sock")
    cmd = torchrun_command(_args("--nproc", "2"), _training(nproc=2))
    at = cmd.index("-m")
    assert cmd[at : at + 4] == ["-m", "rollouts.forkserver.proxy", "-m", "rollouts.cli"]
    assert cmd[:at] + cmd[at + 2 :] == plain


def test_several_nodes_meet_at_the_rendezvous() -> None:
    config = _training(nproc=8, nnodes=4, rdzv_endpoint="node001:29500")
    cmd = torchrun_command(_args("--node-rank", "2", "--resume"), config)
    head = cmd[: cmd.index("-m")]
    assert head[1:] == [
        "--nproc_per_node=8",
        "--nnodes=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node001:29500",
        "--rdzv-id=demo",
        "--node-rank=2",
    ]
    tail = " ".join(cmd[len(head) :])
    assert "training.nnodes=4" in tail and "training.rdzv_endpoint=node001:29500" in tail
    assert cmd[-1] == "--resume"


def test_torchrun_is_needed_once_for_several_processes() -> None:
    two_nodes = _training(nnodes=2, rdzv_endpoint="10.0.0.1:29500")
    assert needs_torchrun(two_nodes, {})  # even with one process per node
    assert not needs_torchrun(two_nodes, {"LOCAL_RANK": "0"})  # torchrun (or srun) started it
    assert not needs_torchrun(_training(), {})


def test_nnodes_needs_a_rendezvous_endpoint() -> None:
    with pytest.raises(ConfigError) as info:
        _training(nnodes=2)
    assert "training.rdzv_endpoint = ''" in str(info.value) and "HOST:PORT" in str(info.value)
    with pytest.raises(ConfigError, match="training.nnodes = 0"):
        _training(nnodes=0)
    with pytest.raises(ConfigError, match="rdzv_endpoint = 'node001'"):
        _training(nnodes=2, rdzv_endpoint="node001")


SRUN = {  # rank 5 of an srun step of 2 nodes x 4 tasks, on the second node
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "MASTER_ADDR": "node001",
    "MASTER_PORT": "29500",
}


def test_slurm_tasks_become_torchrun_ranks() -> None:
    ranks = slurm_ranks(SRUN)
    assert ranks == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
    }
    env = SRUN | ranks
    assert local_world_size(env) == 4 and not shares_node_with_driver(env)
    assert shares_node_with_driver({"RANK": "3", "LOCAL_RANK": "3"})


def test_slurm_without_a_step_or_under_torchrun_changes_nothing() -> None:
    batch_shell = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert slurm_ranks(batch_shell) == {}  # the batch script itself, not a task of srun
    assert slurm_ranks(SRUN | {"RANK": "0"}) == {}  # srun started torchrun, which set them
    assert slurm_ranks(SRUN | {"SLURM_STEP_NUM_TASKS": "1"}) == {}


def test_srun_tasks_are_the_ranks_only_when_the_config_asks_for_one_process() -> None:
    assert srun_ranks(_training(), SRUN)["WORLD_SIZE"] == "8"  # one task per GPU
    per_node = _training(nproc=4, nnodes=2, rdzv_endpoint="node001:29500")
    assert srun_ranks(per_node, SRUN) == {}  # one task per node: each runs torchrun


def test_slurm_without_master_addr_names_the_fix() -> None:
    env = {k: v for k, v in SRUN.items() if k != "MASTER_ADDR"}
    with pytest.raises(ValueError) as info:
        slurm_ranks(env)
    assert "MASTER_ADDR is not set" in str(info.value) and "scontrol show hostnames" in str(
        info.value
    )


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="cannot read"):
        tasks_per_node("2(3)")


def test_a_checkpoint_dir_some_rank_cannot_see_is_refused_with_the_fix() -> None:
    root = Path("/local/runs/x")
    assert unshared_problem(root, [("node001", True), ("node002", True)]) == ""
    problem = unshared_problem(root, [("node001", True), ("node002", False), ("node002", False)])
    assert "/local/runs/x is not shared" in problem
    assert "rank 1 on node002, rank 2 on node002" in problem and "rank 0 on node001" in problem
    assert "set run.output_dir (or checkpoint.dir)" in problem


def test_resume_step_goes_through_the_relaunch() -> None:
    cmd = torchrun_command(_args("--resume-step", "12"), _training(nproc=2))
    assert cmd[-2:] == ["--resume-step", "12"], cmd
