"""`engines.builtin.dtype`: a built-in engine serving bf16 weights, and the content check's
tolerance following the coarser side (issue 29, item 4)."""

from __future__ import annotations

from pathlib import Path

import torch

from rollouts.config import config_from_dict
from rollouts.engine.launch import engine_server
from rollouts.inference.vllm import VLLMEngine
from rollouts.weights.check import TOLERANCE, mean_gap, probe_dtype
from tests.hf_reference import teacher_forced_logprobs

PROMPT = [5, 9, 2, 7, 11, 3, 8]


def test_the_check_tolerance_follows_the_coarser_side() -> None:
    assert probe_dtype(config_from_dict({})) == "float32"
    bf16_engine = {"engines": {"builtin": {"dtype": "bfloat16"}}}
    assert probe_dtype(config_from_dict(bf16_engine)) == "bfloat16"
    vllm = {"engines": {"kind": "vllm", "urls": ["http://h:1"]}, "training": {"backend": "fsdp"}}
    assert probe_dtype(config_from_dict(vllm)) == "float32"  # vLLM's dtype is its own flag


def test_an_auto_device_on_a_gpu_box_probes_in_bf16(monkeypatch) -> None:
    """`training.device = "auto"` reads as CUDA where torch sees a GPU: a bf16 probe, as for
    "cuda" (it once compared the string "auto" with "cuda" and probed in fp32)."""
    vllm = {"engines": {"kind": "vllm", "urls": ["http://h:1"]}, "training": {"device": "auto"}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert probe_dtype(config_from_dict(vllm)) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe_dtype(config_from_dict(vllm)) == "float32"


async def test_a_bf16_engine_serves_bf16_weights(tiny_model_dir: Path, ref_model) -> None:
    expected = teacher_forced_logprobs(ref_model, PROMPT[:1], PROMPT[1:])
    gaps, means = {}, {}
    for dtype in ("float32", "bfloat16"):
        async with engine_server(tiny_model_dir, dtype=dtype) as url:
            engine = VLLMEngine(url)
            served = torch.tensor(await engine.prompt_logprobs(PROMPT))
            await engine.aclose()
        gaps[dtype] = float((served - expected).abs().max())
        means[dtype] = mean_gap(expected.tolist(), served.tolist())
    assert gaps["float32"] < 1e-4, gaps
    assert gaps["bfloat16"] > 1e-4, gaps  # rounded
    assert means["bfloat16"] < TOLERANCE["bfloat16"], means  # not another model
