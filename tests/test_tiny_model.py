from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.config import Config, load_config
from rollouts.driver.setup import prepare_base_model
from rollouts.models.tiny import TinyModelSpec, build_tiny_model, train_tokenizer


def test_round_trip_same_logits_and_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.save_pretrained(tmp_path / "again")
    tok.save_pretrained(tmp_path / "again")
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, logits)
        assert torch.equal(model2.generate(ids, max_new_tokens=6, do_sample=False), out)
    assert out.shape[1] > ids.shape[1]


def test_tokenizer_is_append_only_and_has_chat_template(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a, b = "What is 12+7?", " It is 19."
    assert tok(a + b)["input_ids"] == tok(a)["input_ids"] + tok(b)["input_ids"]
    assert tok.decode(tok(a)["input_ids"]) == a
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    prefix = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prefix)


def test_bpe_tokenizer_learns_merges_but_splits_digits() -> None:
    corpus = ["the quick brown fox jumps over the lazy dog 12345"] * 50
    tok = train_tokenizer(corpus, kind="bpe", vocab_size=300)
    ids = tok("the quick 123")["input_ids"]
    assert len(ids) < len("the quick 123")  # merges learned
    assert tok.decode(ids) == "the quick 123"
    assert [tok.decode([i]) for i in tok("123")["input_ids"]] == ["1", "2", "3"]


def test_model_sized_from_spec() -> None:
    tok = train_tokenizer([], kind="char")
    model = build_tiny_model(TinyModelSpec(hidden_size=16, num_heads=2, num_layers=1), tok)
    assert model.config.vocab_size == len(tok)
    assert model.config.num_hidden_layers == 1


def test_cli_make_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "m"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rollouts.cli",
            "make-tiny-model",
            str(out),
            "--hidden-size",
            "16",
            "--num-heads",
            "2",
            "--num-layers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 16


def test_a_built_tiny_model_is_reused_only_for_the_spec_it_was_built_from(tmp_path: Path) -> None:
    """Every run seed reuses one built model (its init seed is model.tiny.seed); other
    [model.tiny] values are an error naming the keys, never a silent stand-in."""
    path = tmp_path / "base"
    tiny = ["model.tiny.enabled=true", "model.tiny.hidden_size=32", "model.tiny.num_layers=1"]

    toml = tmp_path / "c.toml"
    toml.write_text("")

    def config(*extra: str) -> Config:
        return load_config(toml, [f"model.path='{path}'", *tiny, *extra])

    assert prepare_base_model(config()) == path
    weights = (path / "model.safetensors").read_bytes()
    assert prepare_base_model(config("run.seed=7")) == path
    assert (path / "model.safetensors").read_bytes() == weights
    with pytest.raises(ValueError, match=r"model.tiny.hidden_size = 64 \(built: 32\)"):
        prepare_base_model(config("model.tiny.hidden_size=64"))
    with pytest.raises(ValueError, match=r"model.tiny.seed = 3 \(built: 0\)"):
        prepare_base_model(config("model.tiny.seed=3"))
