"""LoRA under FSDP2 (`torchrun --nproc_per_node 2`, gloo on CPU) against the one-device LoRA
backend: the same adapter after the same steps, the base model's logprobs with the adapters
off, a checkpoint that resumes exactly (on either backend), and files PEFT and transformers load.
One torchrun run (`fsdp_lora_worker.py`) gives every check its data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollouts.trainer.checkpoint import load_checkpoint
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.lora import ADAPTER_DIR
from tests import programs
from tests.training.backend_helpers import (
    lora_config,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)
from tests.training.fsdp_lora_worker import BATCHES
from tests.training.test_fsdp import REPO, _free_port


@pytest.fixture(scope="module")
def fsdp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp-lora")
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
        "tests.training.fsdp_lora_worker",
        str(tiny_model_dir),
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = programs.run(cmd, cwd=REPO, env=env, timeout=180)  # forked, and each rank
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out / "result.pt", weights_only=False) | {"out": out}


def _step(backend, s: int) -> float:
    loss = backend.forward_backward(BATCHES[s], nll_loss).result()["loss"]
    backend.optim_step().result()
    return loss


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def test_lora_under_fsdp_trains_the_adapter_the_one_device_backend_trains(
    fsdp: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert fsdp["world_size"] == 2
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    losses = [_step(backend, s) for s in range(3)]
    size = backend.save_adapter(tmp_path / "one").result()
    merged = backend.get_weights()
    logprobs = backend.compute_logprobs(BATCHES[4]).result()
    backend.close()
    assert losses == pytest.approx(fsdp["losses"], rel=1e-5)
    assert fsdp["adapter_bytes"] == size
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    _close(load_file(fsdp["out"] / "adapter" / "adapter_model.safetensors"), one, atol=1e-6)
    _close(fsdp["merged"], merged, atol=1e-6)
    for a, b in zip(fsdp["logprobs"], logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_base_logprobs_under_fsdp_are_a_separately_loaded_base_models(
    fsdp: dict, tiny_model_dir: Path
) -> None:
    plain = create_pytorch_backend(tiny_config(tiny_model_dir))
    base = plain.compute_logprobs(BATCHES[4]).result()
    plain.close()
    for b, r, p in zip(base, fsdp["base_logprobs"], fsdp["logprobs"], strict=True):
        torch.testing.assert_close(r, b, rtol=0, atol=1e-6)
        assert (r - p).abs().max() > 1e-4  # the policy itself has moved away
    saved = AutoModelForCausalLM.from_pretrained(fsdp["out"] / "base").state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)


def test_an_fsdp_lora_checkpoint_resumes_exactly_on_either_backend(
    fsdp: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _close(fsdp["step4_resumed"], fsdp["step4"], atol=0)
    path = Path(fsdp["checkpoint"])
    assert (path / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert (path / "optimizer").is_dir()  # DCP: the adapters' AdamW state, sharded
    one = create_pytorch_backend(lora_config(tiny_model_dir))  # the DCP state of 2 ranks
    load_checkpoint(one, path)
    _step(one, 3)
    one.save_adapter(tmp_path / "step4").result()
    one.close()
    _close(load_file(tmp_path / "step4" / "adapter_model.safetensors"), fsdp["step4"], 1e-6)


def test_the_adapter_and_the_merged_model_written_under_fsdp_load(
    fsdp: dict, tiny_model_dir: Path
) -> None:
    ids = BATCHES[4].input_ids[1]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft = PeftModel.from_pretrained(base, fsdp["out"] / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(Path(fsdp["checkpoint"]) / "model")
    expected = fsdp["logprobs"][1][1:]
    for lm in (peft, merged):
        with torch.no_grad():
            logits = lm(input_ids=ids[None]).logits[0, :-1].float()
        got = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
