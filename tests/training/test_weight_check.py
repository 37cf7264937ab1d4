"""The content check of a weight sync, against the real built-in engine: the engine's prompt
logprobs of a probe must match the trainer's; a tied LM head is written for in-place reloads."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollouts.engine.launch import engine_server
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sync import SyncOptions, WeightSyncError
from rollouts.inference.vllm import VLLMEngine
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.trainer.factories import create_pytorch_backend
from rollouts.weights.check import (
    WeightContentError,
    check_engines_at_start,
    largest_gap,
    probe_ids,
    tolerance_for,
    trainer_probe,
)
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.files import publish_weights
from tests.training.backend_helpers import one_torch_thread, tiny_config  # noqa: F401

TIED = TinyModelSpec(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, tie_embeddings=True
)

pytestmark = pytest.mark.slow  # scheduled first: see tests/conftest.py


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), TIED)


def _reference(model_dir: Path, ids: tuple[int, ...]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids_T = torch.tensor(ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids_T[None]).logits[0, :-1], dim=-1)
    return logprobs.gather(1, ids_T[1:, None]).squeeze(1).tolist()


def _scaled(backend: object, factor: float, only: str = "") -> None:
    """Move the trainer's weights (all, or those whose name contains `only`) by `factor`."""
    weights = backend.get_weights()  # type: ignore[attr-defined]
    if backend.lm.config.tie_word_embeddings:  # type: ignore[attr-defined]
        del weights["lm_head.weight"]  # the same parameter as the embedding: moved with it
    backend.load_weights({k: v * factor if only in k else v for k, v in weights.items()})  # type: ignore[attr-defined]


async def test_builtin_prompt_logprobs_match_transformers_on_both_routes(
    tiny_model_dir: Path,
) -> None:
    ids = probe_ids(200, 24, seed=3)
    expected = _reference(tiny_model_dir, ids)
    async with engine_server(tiny_model_dir) as url:
        for engine in (SGLangEngine(url), VLLMEngine(url)):
            served = await engine.prompt_logprobs(ids)
            assert largest_gap(expected, served)[0] < 1e-5, type(engine).__name__
            await engine.aclose()
        async with httpx.AsyncClient(base_url=url) as client:  # the wire shapes, top-k and ranks
            body = {"prompt": list(ids[:4]), "max_tokens": 1, "prompt_logprobs": 2}
            answer = (await client.post("/v1/completions", json=body)).json()
            sglang_body = {"input_ids": list(ids[:4]), "return_logprob": True}
            sglang = await client.post("/generate", json=sglang_body | {"logprob_start_len": 2})
    entries = answer["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    own = entries[1][str(ids[1])]
    assert own["logprob"] == pytest.approx(expected[0], abs=1e-5)
    assert own["rank"] >= 1 and set(own) == {"logprob", "rank", "decoded_token"}
    assert {e["rank"] for e in entries[1].values()} >= {1, 2}  # the top two are there too
    inputs = sglang.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inputs] == list(ids[2:4])  # from logprob_start_len on
    assert inputs[0][0] == pytest.approx(expected[1], abs=1e-5)


def test_tied_lm_head_is_written_for_engines(tied_model_dir: Path, tmp_path: Path) -> None:
    """save_pretrained drops a tied head; an in-place reload (vLLM) then keeps the old head."""
    backend = create_pytorch_backend(tiny_config(tied_model_dir), total_steps=1)
    before = backend.lm.get_output_embeddings().weight.clone()
    _scaled(backend, 1.05, only="embed")
    assert torch.allclose(backend.lm.get_output_embeddings().weight, before * 1.05)
    backend.save_weights(tmp_path / "sync").result()
    backend.write_weights(backend.snapshot_weights(), tmp_path / "snap")
    backend.close()
    for where in ("sync", "snap"):
        tensors = load_file(tmp_path / where / "model.safetensors")
        assert "lm_head.weight" in tensors, where
        assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


async def test_a_bf16_engine_gets_bf16_files_and_serves_what_fp32_files_gave_it(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    # weight_sync.dtype = "auto": the files for a bf16 built-in engine are bf16 (on the H100 the
    # fp32 files took 1.8 s of a 2.0 s sync); the engine casts on load, so nothing it serves
    # changes
    import dataclasses

    from rollouts.config import EnginesConfig
    from rollouts.config.engine_options import EngineOptions

    fp32 = tiny_config(tied_model_dir)
    engines = EnginesConfig(builtin=EngineOptions(dtype="bfloat16"))
    bf16 = dataclasses.replace(fp32, engines=engines)
    sizes, served = {}, {}
    ids = probe_ids(200, 16, seed=5)
    async with engine_server(tied_model_dir, dtype="bfloat16", weight_version="0") as url:
        engine = SGLangEngine(url)
        for name, config in (("fp32", fp32), ("bf16", bf16)):
            backend = create_pytorch_backend(config, total_steps=1)
            _scaled(backend, 1.03)
            path = await trio.to_thread.run_sync(
                publish_weights, backend, tmp_path / name, f"{name}-1"
            )
            backend.close()
            tensors = load_file(path / "model.safetensors")
            dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
            assert dtypes == {torch.float32 if name == "fp32" else torch.bfloat16}, name
            sizes[name] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            await sync_weights_to_engines([engine], path, f"{name}-1")
            served[name] = await engine.prompt_logprobs(ids)
        await engine.aclose()
    assert sizes["bf16"] < 0.55 * sizes["fp32"], sizes
    assert served["bf16"] == served["fp32"]


async def test_sync_fails_an_engine_that_serves_other_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The engine reloads files of the OLD weights under the new version: the label matches,
    the content does not; the error names the engine, the gap and the version."""
    backend = create_pytorch_backend(tiny_config(tiny_model_dir), total_steps=1)
    ids = probe_ids(200, 32, seed=0)
    stale = await trio.to_thread.run_sync(publish_weights, backend, tmp_path / "w", "0")
    _scaled(backend, 1.02)
    fresh = await trio.to_thread.run_sync(publish_weights, backend, tmp_path / "w", "1")
    probe = await trainer_probe(backend, ids, "1", tolerance_for("float32", 0.0))
    backend.close()
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        engine = SGLangEngine(url)
        with pytest.raises(WeightSyncError) as caught:
            await sync_weights_to_engines(
                [engine],
                stale,
                "1",
                options=SyncOptions(attempts=2, retry_delay_s=0.0),
                probe=probe,
            )
        report = await sync_weights_to_engines([engine], fresh, "1", probe=probe)
        await engine.aclose()
    message = str(caught.value)
    assert url in message and "does not serve the trainer's weights" in message
    assert "after 2 attempt(s)" in message and "'1'" in message
    assert report.ok and report.results[0].content_gap < 1e-5
    metrics = report.metrics()
    assert metrics["content_gap_max"] < 1e-5 and metrics["check_s_max"] > 0


async def test_start_check_names_an_engine_serving_another_model(
    tiny_model_dir: Path, tied_model_dir: Path
) -> None:
    backend = create_pytorch_backend(tiny_config(tiny_model_dir), total_steps=1)
    probe = await trainer_probe(backend, probe_ids(200, 16, seed=0), "0", 1e-3)
    backend.close()
    async with engine_server(tiny_model_dir) as same, engine_server(tied_model_dir) as other:
        engines = [SGLangEngine(same), SGLangEngine(other)]
        with pytest.raises(WeightContentError, match="at start") as caught:
            await check_engines_at_start(engines, probe)
        for engine in engines:
            await engine.aclose()
    assert other in str(caught.value) and same not in str(caught.value)


def test_largest_gap_flags_nan_and_length() -> None:
    assert largest_gap([0.0, -1.0], [0.0, -1.5]) == (0.5, 1)
    assert largest_gap([0.0], [0.0, 1.0])[0] == float("inf")
    assert largest_gap([0.0, 1.0], [0.0, float("nan")]) == (float("inf"), 1)
    assert probe_ids(100, 8, 1) == probe_ids(100, 8, 1) != probe_ids(100, 8, 2)
