"""Weight sync against the real built-in engine server; failure handling by fault injection."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import trio

from rollouts.data.sft import tokenize_conversation
from rollouts.engine.launch import engine_server
from rollouts.inference.http import HttpOptions
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sync import SyncOptions, WeightSyncError
from rollouts.trainer.factories import create_pytorch_backend, load_tokenizer
from rollouts.types import TrainBatch
from rollouts.weights.disk import sync_weights_to_engines
from rollouts.weights.files import publish_weights
from rollouts.wire.generation import SamplingParams
from tests.training.backend_helpers import (
    nll_loss,
    one_torch_thread,  # noqa: F401 (autouse)
    tiny_config,
)

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def _greedy(lm: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = lm(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _train_to_memorise(model_dir: Path) -> tuple[object, list[int], list[int]]:
    tokenizer = load_tokenizer(model_dir)
    tokens, mask = tokenize_conversation(tokenizer, MESSAGES)
    batch = TrainBatch(
        input_ids=(torch.tensor(tokens),),
        loss_mask=(torch.tensor(mask, dtype=torch.float32),),
        num_global_tokens=float(sum(mask)),
        num_global_seqs=1.0,
    )
    backend = create_pytorch_backend(tiny_config(model_dir), total_steps=60)
    for _ in range(60):
        backend.forward_backward(batch, nll_loss).result()
        backend.optim_step().result()
    prompt_len = mask.index(1)
    response = [t for t, m in zip(tokens, mask, strict=True) if m]  # the assistant's turn
    return backend, tokens[:prompt_len], response


async def test_sync_makes_a_running_engine_serve_the_trained_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend, prompt, response = await trio.to_thread.run_sync(_train_to_memorise, tiny_model_dir)
    trained = _greedy(backend.lm, prompt, len(response))
    assert trained == response  # the trainer memorised the answer
    greedy = SamplingParams(max_new_tokens=len(response), temperature=0.0, ignore_eos=True)
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        engine = SGLangEngine(url)
        before = await engine.generate(prompt, greedy)
        assert list(before.output_ids) != trained and before.weight_version == "0"
        path = await trio.to_thread.run_sync(publish_weights, backend, tmp_path / "w", "1")
        report = await sync_weights_to_engines([engine], path, "1")
        after = await engine.generate(prompt, greedy)
        await engine.aclose()
    backend.close()
    assert report.ok and report.results[0].attempts == 1
    assert list(after.output_ids) == trained
    assert after.weight_version == "1"
    assert set(report.metrics()) >= {"total_s", "pause_s_max", "load_s_max", "verify_s_max"}
    assert report.results[0].load_s > 0


class _FlakyServer:
    """An SGLang-shaped fake whose reload fails `failures` times (fault injection)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.version = "0"
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.path)
        if request.url.path == "/update_weights_from_disk":
            if self.failures > 0:
                self.failures -= 1
                return httpx.Response(400, json={"success": False, "message": "disk full"})
            self.version = json.loads(request.content)["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.version})
        return httpx.Response(200, json={})


def _engine(server: _FlakyServer, url: str) -> SGLangEngine:
    options = HttpOptions(max_retries=0, timeout_s=5.0)
    return SGLangEngine(url, options=options, transport=httpx.MockTransport(server))


async def test_a_failing_engine_is_retried_reported_and_always_resumed(
    tiny_model_dir: Path,
) -> None:
    good, flaky, dead = _FlakyServer(0), _FlakyServer(1), _FlakyServer(99)
    engines = [_engine(s, f"http://e{i}") for i, s in enumerate((good, flaky, dead))]
    with pytest.raises(WeightSyncError, match="1 of 3") as info:
        await sync_weights_to_engines(
            engines, tiny_model_dir, "7", options=SyncOptions(attempts=3, retry_delay_s=0.0)
        )
    report = info.value.report
    assert [r.attempts for r in report.results] == [1, 2, 3]
    assert [r.ok for r in report.results] == [True, True, False]
    assert "disk full" in report.results[2].error
    assert (good.version, flaky.version, dead.version) == ("7", "7", "0")
    for server, attempts in ((good, 1), (flaky, 2), (dead, 3)):  # resumed after every attempt
        assert server.calls.count("/pause_generation") == attempts
        assert server.calls.count("/continue_generation") == attempts
    lenient = await sync_weights_to_engines(
        engines[2:], tiny_model_dir, "8", options=SyncOptions(attempts=1), strict=False
    )
    assert not lenient.ok and lenient.metrics()["failed_engines"] == 1.0
    for engine in engines:
        await engine.aclose()


async def test_sync_refuses_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    engine = _engine(_FlakyServer(0), "http://e")
    with pytest.raises(FileNotFoundError, match="config.json"):
        await sync_weights_to_engines([engine], tmp_path, "1")
    await engine.aclose()


def _inode(version_dir: Path) -> int:
    return (version_dir / "model.safetensors").stat().st_ino


def _perturbed(backend: object) -> dict[str, torch.Tensor]:
    """New weights in the backend (as a step gives), returned."""
    weights = {k: v + 0.01 for k, v in backend.get_weights().items()}  # type: ignore[attr-defined]
    backend.load_weights(weights)  # type: ignore[attr-defined]
    return weights


def test_a_publish_rewrites_the_version_it_prunes_in_place(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rollouts.engine.weights import read_safetensors_dir

    backend = create_pytorch_backend(tiny_config(tiny_model_dir))
    root = tmp_path / "w"
    v1 = publish_weights(backend, root, "1")
    first = _inode(v1)
    v2 = publish_weights(backend, root, "2")
    kept = read_safetensors_dir(v2)
    weights = _perturbed(backend)
    v3 = publish_weights(backend, root, "3")
    assert sorted(p.name for p in root.iterdir()) == ["v_2", "v_3"]
    assert _inode(v3) == first  # the pruned version's file, rewritten: no new pages
    served = read_safetensors_dir(v3)
    assert all(torch.equal(served[k], weights[k]) for k in weights)
    again = read_safetensors_dir(v2)  # the newest before it is left as it was
    assert all(torch.equal(again[k], kept[k]) for k in kept)
    _perturbed(backend)
    second = _inode(v2)
    v4 = publish_weights(backend, root, "4")
    assert _inode(v4) == second  # now v_2's file, the oldest
    assert sorted(p.name for p in root.iterdir()) == ["v_3", "v_4"]
    assert not torch.equal(
        read_safetensors_dir(v4)["model.embed_tokens.weight"], served["model.embed_tokens.weight"]
    )
    # one version kept: the newest (the one engines load or restart on) is never rewritten
    solo = tmp_path / "solo"
    s1 = publish_weights(backend, solo, "1", keep_last=1)
    before, inode = read_safetensors_dir(s1), _inode(s1)
    _perturbed(backend)
    s2 = publish_weights(backend, solo, "2", keep_last=1)
    assert _inode(s2) != inode and not s1.exists()
    assert not torch.equal(
        read_safetensors_dir(s2)["model.embed_tokens.weight"], before["model.embed_tokens.weight"]
    )
    backend.close()
