"""Real engine servers for the inference tests, started together once per session (blocking
fixtures, since pytest-trio fixtures cannot outlive one test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollouts.inference.launch import EngineProcess, EngineSpec, spawn, wait_healthy_sync
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

API_KEY = "test-key"


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path) -> Iterator[dict[str, EngineProcess]]:
    """Three servers on the tiny model, started in parallel: "main" (open), "keyed" (API key,
    small batch; the weight-reload test changes its weights and restores them), and "spare"
    (the pool test kills it)."""
    model = str(tiny_model_dir)
    procs = {
        "main": spawn(EngineSpec(model_dir=model, max_batch=8)),
        "keyed": spawn(EngineSpec(model_dir=model, max_batch=2, api_key=API_KEY)),
        "spare": spawn(EngineSpec(model_dir=model, max_batch=8)),
    }
    try:
        for proc in procs.values():
            wait_healthy_sync(proc, 120.0)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The served model, loaded in this process (fp32) for reference outputs."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the served model, other seed: different greedy outputs."""
    out = tmp_path_factory.mktemp("tiny-model-seed1")
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    return make_tiny_model(out, spec)


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """`model.generate(do_sample=False)` continuation of one prompt."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, attention_mask=None
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]):
    """log p(output[t] | prompt + output[:t]) from one forward pass."""
    full = torch.tensor([prompt + output])
    logits = model(full).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="session")
def fault_servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Two servers for the fault tests, started in parallel: "rooted" (reloads only from inside
    its `--weights-root`, `fault_servers["rooted"].root`), and "short" (2 s request timeout, a
    queue of 4, 1 MB bodies)."""
    root = tmp_path_factory.mktemp("weights-root")
    model = str(tiny_model_dir)
    procs = {
        "rooted": spawn(EngineSpec(model_dir=model, max_batch=4, weights_roots=(str(root),))),
        "short": spawn(
            EngineSpec(
                model_dir=model,
                max_batch=2,
                max_queue=4,
                extra_args=("--request-timeout-s", "2", "--max-body-mb", "1"),
            )
        ),
    }
    try:
        for proc in procs.values():
            wait_healthy_sync(proc, 120.0)
        yield {**procs, "root": root}
    finally:
        for proc in procs.values():
            proc.stop()
