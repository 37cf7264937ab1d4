"""[model] freeze: the named parameters keep their loaded values, get no gradient and no optimizer
state, under either name of a tied weight; a checkpoint resumes exactly; a name that matches
nothing, or freezing everything, is refused with the names there are."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rollouts.config import ConfigError, LoraConfig, ModelConfig, load_config
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollouts.trainer.factories import create_pytorch_backend
from tests.training.backend_helpers import (
    one_torch_thread,  # noqa: F401 (autouse)
    straight_and_resumed,
    tiny_config,
    train_steps,
)


def _frozen(model_dir: Path, *freeze: str):
    config = tiny_config(model_dir)
    return dataclasses.replace(config, model=ModelConfig(path=str(model_dir), freeze=list(freeze)))


def _weights(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.lm.named_parameters()}


def test_frozen_parameters_keep_their_values_and_hold_no_optimizer_state(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = create_pytorch_backend(_frozen(tiny_model_dir, "embed_tokens", "layers.0.mlp"))
    said = capsys.readouterr().out
    before = _weights(backend)
    frozen = {n for n in before if "embed_tokens" in n or ".layers.0.mlp." in n}
    assert len(frozen) == 4  # the embeddings and layer 0's gate, up and down projections
    assert "[model] freeze:" in said and "model.embed_tokens.weight" in said
    train_steps(backend, range(2))
    after = _weights(backend)
    for name in before:
        assert torch.equal(after[name], before[name]) == (name in frozen), name
    held = [p for group in backend.core.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(before) - len(frozen) == len(backend.core.optimizer.state)
    # what a sync or a checkpoint writes still holds every weight, the frozen ones as loaded
    weights = backend.get_weights()
    assert torch.equal(weights["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    backend.close()


def test_a_frozen_run_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = _frozen(tiny_model_dir, "embed_tokens")
    expected, resumed, _ = straight_and_resumed(config, tmp_path, _weights)
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=0, atol=0)


def test_a_tied_head_is_frozen_under_either_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = TinyModelSpec(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, tie_embeddings=True
    )
    model_dir = make_tiny_model(tmp_path / "tied", spec)
    for name in ("lm_head", "embed_tokens"):
        backend = create_pytorch_backend(_frozen(model_dir, name))
        assert backend.lm.lm_head.weight is backend.lm.get_input_embeddings().weight
        assert not backend.lm.lm_head.weight.requires_grad
        assert sum(p.requires_grad for p in backend.lm.parameters()) > 0
        assert "(model.embed_tokens.weight = lm_head.weight)" in capsys.readouterr().out
        backend.close()


def test_a_name_that_matches_nothing_or_everything_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"model.freeze: 'embeddings' names no parameter.*"):
        create_pytorch_backend(_frozen(tiny_model_dir, "embeddings"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):  # the names there are
        create_pytorch_backend(_frozen(tiny_model_dir, "layers.7"))
    with pytest.raises(ValueError, match="freezes every parameter"):
        create_pytorch_backend(_frozen(tiny_model_dir, "*"))
    # a glob over names: every layer's attention
    backend = create_pytorch_backend(_frozen(tiny_model_dir, "model.layers.*.self_attn.*"))
    trained = {n for n, p in backend.lm.named_parameters() if p.requires_grad}
    assert trained and not any("self_attn" in n for n in trained)
    backend.close()


def test_freeze_with_lora_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "m"\nfreeze = ["embed_tokens"]\n[model.lora]\nenabled = true')
    with pytest.raises(ConfigError, match="LoRA already trains only its adapters"):
        load_config(path)
    assert ModelConfig(freeze=["embed_tokens"], lora=LoraConfig()).problems() == []


def test_a_checkpoint_of_other_frozen_parameters_is_refused_by_name(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = create_pytorch_backend(_frozen(tiny_model_dir, "embed_tokens"))
    train_steps(first, range(1))
    path = save_checkpoint(first, tmp_path, step=1, weight_version="1")
    first.close()
    for other in (tiny_config(tiny_model_dir), _frozen(tiny_model_dir, "lm_head")):
        second = create_pytorch_backend(other)  # all trained; the same count, other shapes
        with pytest.raises(ValueError, match=r"optimizer.pt does not fit .*model.freeze"):
            load_checkpoint(second, path)
        second.close()
