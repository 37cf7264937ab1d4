"""Two nodes on one machine: train.py started on each "node" (its own process and working
directory) with `--nnodes 2 --rdzv-endpoint 127.0.0.1:PORT` re-runs itself under a multi-node
torchrun (`--nnodes 2 --nproc_per_node 1 --rdzv-backend c10d`); the two agents meet, rank 0
drives and rank 1 trains its FSDP shard (gloo, CPU). The SFT run is killed after a checkpoint,
both nodes resume, and the weights end where one process's do; an RL run syncs the two nodes'
weights to the built-in engine beside rank 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import programs
from tests.training.test_train_e2e import ROOT, TRAIN, _config, _steps

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py

STEPS = 4
KILL_AFTER = "step_000002"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # torchrun beside this python
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=path)


def _sft_config(tmp: Path) -> Path:
    return _config(
        tmp,
        # "pad" on both sides: "auto" gives one process the prefix layout (its SFT conversations
        # share their system message), whose floats differ from the ranks' "pad" in the last bits
        training={"sft_steps": STEPS, "sft_batch_size": 8, "micro_batch_layout": "pad"},
        checkpoint={"every": 1, "keep_last": STEPS},
    )


def _start_nodes(tmp: Path, config: Path, *extra: str, mode: str = "sft") -> list[subprocess.Popen]:
    """One train.py per node, each in its own working directory and session."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for node in (0, 1):
        work = tmp / f"node{node}"
        work.mkdir(exist_ok=True)
        cmd = [sys.executable, str(TRAIN), "--mode", mode, "--config", str(config)]
        cmd += ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint, *extra]
        log = (work / "train.log").open("a")
        proc = subprocess.Popen(
            cmd, cwd=work, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        nodes.append(proc)
    return nodes


def _logs(tmp: Path) -> str:
    return "\n".join((tmp / f"node{n}" / "train.log").read_text()[-3000:] for n in (0, 1))


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts its workers in sessions of their own)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += _tree(int(child))
    return found


def _kill(nodes: list[subprocess.Popen]) -> None:
    pids = [pid for proc in nodes for pid in _tree(proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    for proc in nodes:
        proc.wait()


def _wait(nodes: list[subprocess.Popen], tmp: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc in nodes:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(nodes)
        raise AssertionError(f"the nodes did not finish:\n{_logs(tmp)}") from None
    codes = [proc.returncode for proc in nodes]
    assert codes == [0, 0], f"{codes=}\n{_logs(tmp)}"


def _losses(run: Path) -> dict[int, float]:
    rows = map(json.loads, (run / "sft_metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["sft/loss"] for r in rows if "sft/loss" in r}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    model = run / "checkpoints" / "sft" / f"step_{STEPS:06d}" / "model"
    return load_file(model / "model.safetensors")


def test_two_nodes_train_like_one_process_and_resume_after_a_kill(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    done = programs.run(
        [sys.executable, TRAIN, "--mode", "sft", "--config", _sft_config(one)],
        timeout=120,
        cwd=ROOT,
        env=_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    two = tmp_path / "two"
    two.mkdir()
    config = _sft_config(two)  # absolute paths: the run directory both nodes see
    run = two / "run"
    nodes = _start_nodes(two, config)
    deadline = time.monotonic() + 120
    try:
        while not (run / "checkpoints" / "sft" / KILL_AFTER).is_dir():
            assert all(p.poll() is None for p in nodes), f"a node ended early:\n{_logs(two)}"
            assert time.monotonic() < deadline, f"no {KILL_AFTER}:\n{_logs(two)}"
            time.sleep(0.1)
    finally:
        _kill(nodes)  # both nodes, agents and ranks, no clean-up
    log0 = (two / "node0" / "train.log").read_text()
    assert "--nnodes=2" in log0 and "--rdzv-backend=c10d" in log0  # the multi-node torchrun
    assert not (run / "checkpoints" / "sft" / f"step_{STEPS:06d}").exists(), "killed too late"

    _wait(_start_nodes(two, config, "--resume"), two)
    assert _steps(run / "sft_metrics.jsonl")[-1] == STEPS
    stepped = [s for s in _steps(run / "sft_metrics.jsonl") if s]
    assert stepped == list(range(1, STEPS + 1)), stepped  # no step twice, none missing
    expected, got = _losses(one / "run"), _losses(run)
    for step in range(1, STEPS + 1):
        assert abs(got[step] - expected[step]) <= 1e-5 * abs(expected[step]), (step, got, expected)
    last = run / "checkpoints" / "sft" / f"step_{STEPS:06d}"
    assert json.loads((last / "manifest.json").read_text())["world_size"] == 2
    shards = sorted(p.name for p in (last / "optimizer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each node wrote its own, in one place
    ours, theirs = _weights(run), _weights(one / "run")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        # atol: 1/300 of one AdamW step at sft_lr 3e-3. The ranks sum the gradient in another
        # order; where an element's gradient is near AdamW's eps, the update scales that
        # rounding up (one lm_head element of 8288 off by 3.9e-6 after 4 steps, the rest
        # within 1.3e-7). A missed or doubled step, or a wrong gradient, is 1e-3 away.
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_two_nodes_run_rl_with_the_engine_beside_rank_0(tmp_path: Path) -> None:
    """SFT then RL on two nodes: rank 0's driver starts the built-in engine on its node, the
    distributed sync reaches it from the FSDP trainer, and the content check passes."""
    config = _config(
        tmp_path,
        data={"eval_size": 2},
        training={"sft_steps": 1, "rl_steps": 2},
        weight_sync={"method": "distributed"},
    )
    _wait(_start_nodes(tmp_path, config, mode="sft+rl"), tmp_path)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["sync/failed_engines"] == 0.0 and rows[-1]["sync/buckets"] >= 1
    assert rows[-1]["sync/content_gap_max"] < 1e-4  # the engine serves the two nodes' weights
    log0 = (tmp_path / "node0" / "train.log").read_text()
    assert "weight-sync rendezvous at 127.0.0.1: every engine is on this host" in log0
