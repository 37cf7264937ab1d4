"""LoRA training on the one-device backend ([model.lora]): only the adapters train and hold
optimizer state, a checkpoint keeps the adapter and resumes exactly, the merged model loads with
transformers, and the reference is the base model for free (the adapters off)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from rollouts.config import AlgorithmConfig, KLConfig
from rollouts.driver.reference_setup import build_reference
from rollouts.trainer.checkpoint import save_checkpoint
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.trainer.lora import ADAPTER_DIR
from tests.training.backend_helpers import (
    STEP_BATCHES,
    lora_config,
    one_torch_thread,  # noqa: F401 (autouse)
    straight_and_resumed,
    tiny_config,
    train_steps,
)


def _adapter(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.lm.named_parameters() if "lora_" in n}


def test_only_the_adapters_train_and_hold_optimizer_state(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    base_before = {n: p.detach().clone() for n, p in backend.lm.named_parameters()}
    trainable = [n for n, p in backend.lm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of every decoder layer, never the LM head
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    train_steps(backend, range(2))
    optimizer = backend.core.optimizer
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len(trainable)
    assert all(p.requires_grad for p in held) and len(optimizer.state) == len(trainable)
    for name, param in backend.lm.named_parameters():
        moved = not torch.equal(param, base_before[name])
        assert moved == ("lora_B" in name or "lora_A" in name), name
    backend.close()


def test_resume_of_a_lora_run_is_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    expected, resumed, path = straight_and_resumed(lora_config(tiny_model_dir), tmp_path, _adapter)
    assert (path / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert not (path / "model").exists()  # no full model unless model.lora.save_merged
    assert resumed.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0)


def test_merged_model_loads_with_transformers_and_computes_the_adapted_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = create_pytorch_backend(lora_config(tiny_model_dir, save_merged=True))
    train_steps(backend, range(2))
    path = save_checkpoint(backend, tmp_path, step=2, weight_version="2")
    (trained,) = backend.compute_logprobs(STEP_BATCHES[0].select([0])).result()
    merged = backend.get_weights()
    backend.close()
    adapter_config = json.loads((path / ADAPTER_DIR / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert not any("lora" in k for k in merged)
    lm = AutoModelForCausalLM.from_pretrained(path / "model")
    assert lm.state_dict().keys() == merged.keys()
    ids = STEP_BATCHES[0].input_ids[0]
    logits = lm(input_ids=ids[None]).logits[0, :-1].float()
    plain = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
    torch.testing.assert_close(plain, trained[1:], rtol=0, atol=1e-5)


def test_adapter_sync_files_are_the_adapter_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    adapters = backend.lora_adapters()
    assert adapters is backend
    size = adapters.save_adapter(tmp_path / "a").result()
    backend.close()
    files = {f.name for f in (tmp_path / "a").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    assert size == sum(
        (tmp_path / "a" / n).stat().st_size for n in files if n.startswith("adapter")
    )
    full = sum(p.numel() * p.element_size() for p in backend.lm.parameters())
    assert size < full / 4, (size, full)


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir: Path) -> None:
    """KL against the base model without a second copy: equal to a separately loaded base."""
    config = lora_config(tiny_model_dir)
    config = dataclasses.replace(config, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.1)))
    policy = create_pytorch_backend(config)
    train_steps(policy, range(3))  # the adapters moved: the policy is not the base any more
    ref = build_reference(config, tiny_model_dir, policy=policy)
    assert ref is not None and ref.backend is None  # no second model was built
    plain = create_pytorch_backend(tiny_config(tiny_model_dir))
    batch = STEP_BATCHES[1]
    from_ref = trio.run(ref.logprobs, batch)
    from_base = plain.compute_logprobs(batch).result()
    from_policy = policy.compute_logprobs(batch).result()
    for r, b, p in zip(from_ref, from_base, from_policy, strict=True):
        torch.testing.assert_close(r, b, rtol=0, atol=1e-6)
        assert (r - p).abs().max() > 1e-4  # the policy itself has moved away
    policy.close()
    plain.close()


def test_load_weights_of_a_lora_backend_is_refused(tiny_model_dir: Path) -> None:
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    weights = backend.get_weights()
    with pytest.raises(NotImplementedError, match="frozen base and an adapter"):
        backend.load_weights(weights)
    backend.close()


def test_base_weights_for_engines_are_the_frozen_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    """What a server already up reloads before its first adapter: the base, not the merged."""
    backend = create_pytorch_backend(lora_config(tiny_model_dir))
    train_steps(backend, range(2))
    backend.lora_adapters().save_base_weights(tmp_path / "base").result()
    backend.close()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)


def test_lora_in_the_trainer_process_gives_the_same_numbers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The adapter capability crosses the socket: base logprobs, the adapter's files."""
    from rollouts.trainer.process import TrainerProcess

    config = lora_config(tiny_model_dir)
    here = create_pytorch_backend(config)
    host = TrainerProcess(threads=1)
    try:
        there = host.create(config)
        for backend in (here, there):
            train_steps(backend, range(2))
        adapters = there.lora_adapters()
        assert adapters is not None
        size = adapters.save_adapter(tmp_path / "a").result()
        base_there = adapters.compute_base_logprobs(STEP_BATCHES[3]).result()
        base_here = here.compute_base_logprobs(STEP_BATCHES[3]).result()
        policy_there = there.compute_logprobs(STEP_BATCHES[3]).result()
        policy_here = here.compute_logprobs(STEP_BATCHES[3]).result()
        there.close()
    finally:
        host.close()
        here.close()
    assert (
        size
        == (tmp_path / "a" / "adapter_model.safetensors").stat().st_size
        + (tmp_path / "a" / "adapter_config.json").stat().st_size
    )
    for a, b in zip(base_there + policy_there, base_here + policy_here, strict=True):
        assert torch.equal(a, b)
