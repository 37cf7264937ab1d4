"""The engine's weight files written tensor by tensor (`write_engine_files`): the same tensors as
`save_pretrained` would write, loadable by safetensors and by transformers, sharded with an index
when asked, cast when a dtype is given, and a tied LM head written out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.engine.weights import read_safetensors_dir
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.hf_files import INDEX_FILE, SINGLE_FILE, write_engine_files
from rollouts.trainer.pytorch import engine_state_dict


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(
        hidden_size=32, num_layers=2, intermediate_size=64, tie_embeddings=request.param
    )
    return make_tiny_model(tmp_path_factory.mktemp("model"), spec)


def _trained(model_dir: Path) -> torch.nn.Module:
    """The model with every weight moved off its initial value (as after a training step)."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return lm


def test_files_hold_every_tensor_exactly_and_load_back(model_dir: Path, tmp_path: Path) -> None:
    lm = _trained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = tmp_path / "w"
    write_engine_files(lm, tok, out, engine_state_dict(lm))
    assert {p.name for p in out.iterdir()} >= {SINGLE_FILE, "config.json", "tokenizer.json"}
    with safe_open(str(out / SINGLE_FILE), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    files = load_file(str(out / SINGLE_FILE))
    live = lm.state_dict()
    for name, t in live.items():
        assert torch.equal(files[name], t), name
    if lm.config.tie_word_embeddings:  # the head is its own entry: an in-place reload sets it
        assert torch.equal(files["lm_head.weight"], lm.get_input_embeddings().weight)
    else:
        assert set(files) == set(live)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    assert torch.equal(back(ids).logits, lm(ids).logits)


def test_a_dtype_casts_floats_and_shards_get_an_index(model_dir: Path, tmp_path: Path) -> None:
    lm = _trained(model_dir)
    out = tmp_path / "w"
    state = engine_state_dict(lm)
    write_engine_files(lm, None, out, state, dtype=torch.bfloat16, max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(state)
    read = read_safetensors_dir(out)  # the built-in engine's reader
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in read.values())
    for name, t in state.items():
        assert read[name].dtype == torch.bfloat16 and torch.equal(read[name], t.to(torch.bfloat16))
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, t in back.state_dict().items():
        assert torch.equal(t, state[name].to(torch.bfloat16)), name


def test_the_files_hold_what_save_pretrained_writes(model_dir: Path, tmp_path: Path) -> None:
    lm = _trained(model_dir)
    lm.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_engine_files(lm, None, tmp_path / "ours", engine_state_dict(lm))
    theirs, ours = (
        load_file(str(tmp_path / "hf" / SINGLE_FILE)),
        read_safetensors_dir(tmp_path / "ours"),
    )
    assert set(theirs) <= set(ours)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config == json.loads((tmp_path / "hf" / "config.json").read_text())


def test_a_loaded_model_keeps_its_weights_when_the_files_are_rewritten_in_place(
    model_dir: Path, tmp_path: Path
) -> None:
    """A sync rewrites a version's files in place two versions later (`disk._recycle`); an
    engine started on that version (a restart) and the trainer's loads must not follow it:
    safetensors maps the files, so a mapped tensor would change under them."""
    from rollouts.config.engine_options import EngineOptions
    from rollouts.engine.app import load_model
    from rollouts.trainer.pytorch import load_hf_weights

    lm = _trained(model_dir)
    out = tmp_path / "v"
    write_engine_files(lm, AutoTokenizer.from_pretrained(model_dir), out, engine_state_dict(lm))
    engine, _ = load_model(EngineOptions(model=str(out)))
    loaded = load_hf_weights(out)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(-1.0)
    write_engine_files(lm, None, out, engine_state_dict(lm))
    assert (out / SINGLE_FILE).stat().st_size > 0
    for name, t in engine.state_dict().items():
        assert torch.equal(t, before[name]), name
    for name, t in loaded.items():
        assert torch.equal(t, before[name]), name
