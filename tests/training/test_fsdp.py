"""FSDP2 under `torchrun --nproc_per_node 2` on CPU (gloo) matches the single-process backend."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from rollouts.trainer.checkpoint import load_checkpoint
from rollouts.trainer.checkpoint_verify import verify_checkpoint
from rollouts.trainer.factories import create_pytorch_backend
from tests import programs
from tests.training.backend_helpers import (
    FSDP_FROZEN,
    LENGTHS,
    fsdp_config,
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
)

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "result.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        *programs.FORKED_RANK,
        "-m",
        "tests.training.fsdp_worker",
        str(tiny_model_dir),
        str(out),
        str(tmp / "ckpt"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = programs.run(cmd, cwd=REPO, env=env, timeout=180)  # forked, and each rank
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False) | {"checkpoint": tmp / "ckpt" / "step_000003"}


def test_fsdp_matches_single_process_after_three_steps(
    fsdp_result: dict, tiny_model_dir: Path
) -> None:
    assert fsdp_result["world_size"] == 2
    backend = create_pytorch_backend(fsdp_config(tiny_model_dir))
    losses = []
    for step in range(3):
        metrics = backend.forward_backward(make_batch(LENGTHS, seed=step), nll_loss).result()
        losses.append(metrics["loss"])
        backend.optim_step().result()
    weights = backend.get_weights()
    logprobs = backend.compute_logprobs(make_batch(LENGTHS, seed=9)).result()
    backend.close()
    assert losses == pytest.approx(fsdp_result["losses"], rel=1e-5)
    assert fsdp_result["metrics"]["num_tokens"] == sum(LENGTHS)
    assert fsdp_result["weights"].keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(fsdp_result["weights"][key], value, atol=1e-5, rtol=1e-4)
    for a, b in zip(fsdp_result["logprobs"], logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fsdp_keeps_frozen_parameters_as_loaded(fsdp_result: dict, tiny_model_dir: Path) -> None:
    """`model.freeze` under FSDP2: layer 0's MLP shares its unit with trained attention weights,
    and after 4 steps (one of them after a resume) it is the loaded model's, bit for bit."""
    from rollouts.trainer.pytorch import load_hf_weights

    loaded = load_hf_weights(tiny_model_dir)
    frozen = [k for k in loaded if f".{FSDP_FROZEN[0]}." in f".{k}"]
    assert len(frozen) == 3, frozen
    for weights in (fsdp_result["weights"], fsdp_result["step4_resumed"]):
        for key in frozen:
            torch.testing.assert_close(weights[key], loaded[key], rtol=0, atol=0)
        assert not torch.equal(
            weights["model.layers.0.self_attn.q_proj.weight"],
            loaded["model.layers.0.self_attn.q_proj.weight"],
        )


def test_fsdp_exports_hf_weights_and_resumes_from_its_checkpoint(fsdp_result: dict) -> None:
    for key, value in fsdp_result["weights"].items():
        torch.testing.assert_close(fsdp_result["exported"][key], value, rtol=0, atol=0)
    for key, value in fsdp_result["step4"].items():
        torch.testing.assert_close(fsdp_result["step4_resumed"][key], value, rtol=0, atol=0)


def test_an_fsdp_checkpoint_records_every_rank_s_shards_with_checksums(fsdp_result: dict) -> None:
    """The manifest names each rank's DCP shard of the optimizer (and every other file) with
    its size and CRC-32, and the checkpoint verifies."""
    path = Path(fsdp_result["checkpoint"])
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()}
    assert set(files) == on_disk - {"manifest.json"}, (files, on_disk)
    shards = [rel for rel in files if rel.startswith("optimizer/") and rel.endswith(".distcp")]
    assert len(shards) == 2, files
    assert all(set(entry) == {"size", "crc32"} for entry in files.values()), files
    assert verify_checkpoint(path).ok


def test_an_fsdp_checkpoint_resumes_on_the_one_process_backend(
    fsdp_result: dict, tiny_model_dir: Path
) -> None:
    """The DCP optimizer of 2 ranks loads into one process: its 4th step is FSDP's 4th step."""
    backend = create_pytorch_backend(fsdp_config(tiny_model_dir))
    load_checkpoint(backend, fsdp_result["checkpoint"])
    backend.forward_backward(make_batch(LENGTHS, seed=3), nll_loss).result()
    backend.optim_step().result()
    step4 = backend.get_weights()
    backend.close()
    for key, value in fsdp_result["step4"].items():
        torch.testing.assert_close(step4[key], value, atol=1e-5, rtol=1e-4)
