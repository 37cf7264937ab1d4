"""LoRA adapters in the built-in server, on vLLM's and SGLang's routes, through both clients:
an adapter sync passes the content check (the engine's logprobs with the adapter equal the
trainer's), requests name the adapter, stale adapters are unloaded, errors are the servers'."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollouts.config import LoraConfig, ModelConfig
from rollouts.engine.adapters import AdapterError, ServedAdapters
from rollouts.engine.launch import engine_server
from rollouts.engine.weights import WeightLoadError
from rollouts.inference.adapters import AdapterSlots
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import AdapterLoader, adapter_name
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import batch_generate_body, generate_body
from rollouts.inference.vllm import VLLMEngine
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.weights.check import probe_ids, tolerance_for, trainer_probe
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.files import publish_adapter, publish_weights
from rollouts.wire.generation import GenerateRequest, SamplingParams
from tests.training.backend_helpers import (
    make_batch,
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)


def _lora_backend(model_dir: Path, steps: int, rank: int = 4):
    config = tiny_config(model_dir)
    lora = LoraConfig(enabled=True, rank=rank, alpha=16.0)
    config = dataclasses.replace(config, model=ModelConfig(path=str(model_dir), lora=lora))
    backend = create_pytorch_backend(config)
    for s in range(steps):
        backend.forward_backward(make_batch([6, 9, 4], seed=s), nll_loss).result()
        backend.optim_step().result()
    return backend


def test_adapter_slots_keep_the_served_one_and_the_one_before() -> None:
    slots = AdapterSlots()
    assert slots.current is None
    assert slots.add("a") == [] and slots.add("b") == []
    assert slots.add("c") == ["a"] and slots.current == "c"
    assert slots.add("c") == [] and slots.names == ["b", "c"]
    slots.forget("c")
    assert slots.current == "b"


def test_served_adapter_is_the_merged_model_and_unloads_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = _lora_backend(tiny_model_dir, steps=2)
    merged = backend.get_weights()
    path, size = publish_adapter(backend.lora_adapters(), tmp_path, "1")
    backend.close()
    assert size > 0 and (path / "adapter_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    served = ServedAdapters(model)
    served.load("one", str(path))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, merged[key], rtol=0, atol=1e-6)
    with pytest.raises(AdapterError, match="already been loaded"):
        served.load("one", str(path))
    served.load("two", str(path))  # the base under it, not base + one + two
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, merged[key], rtol=0, atol=1e-6)
    served.unload("one")  # not the merged one: nothing moves
    served.unload("two")
    for key, value in model.state_dict().items():
        assert torch.equal(value, base[key]), key
    with pytest.raises(AdapterError, match="cannot be found"):
        served.unload("two")
    with pytest.raises(WeightLoadError, match="adapter_config.json"):
        served.load("bad", str(tmp_path))


def test_a_bf16_server_merges_from_the_files_fp32_base(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """low(W + delta), as a full sync of the merged model serves it; not low(low(W) + delta),
    which drops every delta under half a bf16 step of low(W) (a policy behind the trained one)."""
    backend = _lora_backend(tiny_model_dir, steps=2)
    merged = backend.get_weights()  # fp32, merged by the trainer
    path, _ = publish_adapter(backend.lora_adapters(), tmp_path / "adapter", "1")
    backend.close()

    def served_by(weights_path: Path | None) -> tuple[ServedAdapters, dict[str, torch.Tensor]]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        served = ServedAdapters(model, None if weights_path is None else str(weights_path))
        served.load("one", str(path))
        return served, model.state_dict()

    def off_grid(own: dict[str, torch.Tensor]) -> float:
        """The fraction of adapted weights that are not the merged model rounded to bf16."""
        keys = [k for k in own if "proj" in k]
        wrong = sum(int((own[k] != merged[k].to(torch.bfloat16)).sum()) for k in keys)
        return wrong / sum(own[k].numel() for k in keys)

    served, own = served_by(tiny_model_dir)
    assert served.precise_base
    precise_off = off_grid(own)
    assert precise_off < 1e-3, precise_off  # the fp32 rounding of the merge, no more
    naive, naive_own = served_by(None)  # the files unknown: merged in bf16
    assert not naive.precise_base
    assert off_grid(naive_own) > 10 * max(off_grid(own), 1e-4), (off_grid(naive_own), off_grid(own))
    # an unload restores the bf16 weights the server loaded
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).state_dict()
    served.unload("one")
    assert all(torch.equal(v, base[k]) for k, v in served.model.state_dict().items())
    # files rewritten since the server loaded them: not its base any more, so not merged from
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_model_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.bfloat16)
    moved = ServedAdapters(model, str(copy))
    next(copy.glob("*.safetensors")).touch()
    moved.load("one", str(path))
    assert not moved.precise_base


def test_request_bodies_name_the_adapter() -> None:
    sampling = SamplingParams(max_new_tokens=2)
    assert "lora_path" not in generate_body([1, 2], sampling, None)
    assert generate_body([1, 2], sampling, None, "policy-v3")["lora_path"] == "policy-v3"
    requests = [GenerateRequest(input_ids=(1, 2), sampling=sampling) for _ in range(3)]
    assert batch_generate_body(requests, "policy-v3")["lora_path"] == ["policy-v3"] * 3
    assert adapter_name("12") == "policy-v12"


async def test_adapter_sync_through_both_clients_passes_the_content_check(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = _lora_backend(tiny_model_dir, steps=3)
    ids = probe_ids(200, 24, seed=0)
    tol = tolerance_for("float32", 0.0)
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        sglang, vllm = SGLangEngine(url), VLLMEngine(url)
        assert isinstance(sglang, AdapterLoader) and isinstance(vllm, AdapterLoader)
        base_served = await sglang.prompt_logprobs(ids)
        for version, engine in (("1", sglang), ("2", vllm), ("3", sglang), ("4", sglang)):
            backend.forward_backward(make_batch([7, 5], seed=10), nll_loss).result()
            backend.optim_step().result()
            path, _ = publish_adapter(backend.lora_adapters(), tmp_path, version)
            probe = await trainer_probe(backend, ids, version, tol)
            report = await sync_weights_to_engines(
                [engine], path, version, probe=probe, adapter=True
            )
            assert report.ok and report.results[0].content_gap < 1e-4, report
            assert await engine.weight_version() == version
        done = await sglang.generate([5, 6, 7], SamplingParams(max_new_tokens=3))
        assert done.weight_version == "4"
        assert sglang.adapters.names == ["policy-v3", "policy-v4"]  # v1 unloaded
        async with httpx.AsyncClient(base_url=url) as client:
            models = (await client.get("/v1/models")).json()["data"]
            loaded = [m["id"] for m in models[1:]]
            named = await client.post(
                "/v1/completions", json={"prompt": [1, 2], "model": "policy-v4", "max_tokens": 1}
            )
            no_adapter = await client.post(
                "/generate", json={"input_ids": [1, 2], "lora_path": "policy-v1"}
            )
            twice = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": "policy-v4", "lora_path": str(path)}
            )
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
            sglang_unload = await client.post("/unload_lora_adapter", json={"lora_name": "nope"})
        await sglang.aclose()
        await vllm.aclose()
    backend.close()
    assert max(abs(a - b) for a, b in zip(base_served, probe.expected, strict=True)) > 1e-3
    assert "policy-v4" in loaded and "policy-v1" not in loaded
    assert named.status_code == 200 and named.json()["model"] == "policy-v4"
    assert no_adapter.status_code == 400 and "not loaded" in no_adapter.text
    assert twice.status_code == 400 and "already been loaded" in twice.text
    assert unload.status_code == 404
    assert sglang_unload.status_code == 400 and sglang_unload.json()["success"] is False


async def test_merged_sync_gives_engines_without_adapters_the_same_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """weight_sync.lora = "merged": the LoRA trainer's full weights (base + adapter, merged)
    reload like any full sync, and the engine then serves the trainer's adapted model."""
    backend = _lora_backend(tiny_model_dir, steps=3)
    ids = probe_ids(200, 24, seed=1)
    path = publish_weights(backend, tmp_path, "1")
    probe = await trainer_probe(backend, ids, "1", tolerance_for("float32", 0.0))
    backend.close()
    assert not any("lora" in name for name in load_file(path / "model.safetensors"))
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        engine = SGLangEngine(url)
        report = await sync_weights_to_engines([engine], path, "1", probe=probe)
        await engine.aclose()
    assert report.ok and report.results[0].content_gap < 1e-4, report


async def test_an_engine_that_comes_back_loads_the_pools_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A restarted engine serves the base model: the pool's health check gives it the adapter
    the others serve (and the version) before it is routed to again."""
    backend = _lora_backend(tiny_model_dir, steps=2)
    path, _ = publish_adapter(backend.lora_adapters(), tmp_path, "7")
    probe = await trainer_probe(backend, probe_ids(200, 16, seed=2), "7", 1e-3)
    backend.close()
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        pool = EnginePool([SGLangEngine(url)])
        pool.set_weights(str(path), "7", adapter=True)
        pool.mark_down(0)  # it exited and came back on its starting model
        await pool.check_health()
        assert pool.up[0] and await pool.weight_version() == "7"
        served = await pool.engines[0].prompt_logprobs(probe.ids)
        await pool.aclose()
    assert max(abs(a - b) for a, b in zip(served, probe.expected, strict=True)) < 1e-4
