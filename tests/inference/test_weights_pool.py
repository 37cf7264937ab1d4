"""API key, weight reload through both clients, and an EnginePool that loses an engine."""

from __future__ import annotations

import httpx
import pytest
import trio

from rollouts.inference.http import EngineRequestError, HttpOptions
from rollouts.inference.pool import EnginePool
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.wire.generation import SamplingParams
from tests.hf_reference import greedy_reference

from .conftest import API_KEY

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
PROMPT = [40, 41, 42, 43, 44]


async def test_api_key_is_required_except_for_health(servers) -> None:
    url = servers["keyed"].url
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/generate", json={"input_ids": [1, 2]})
        assert r.status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert (await http.get("/v1/models", headers=bad)).status_code == 401
    engine = SGLangEngine(url)
    with pytest.raises(EngineRequestError) as info:
        await engine.generate([1, 2], GREEDY)
    assert info.value.status == 401
    await engine.aclose()


async def test_weight_reload_changes_output_and_version(
    servers, ref_model, other_model_dir, tiny_model_dir
) -> None:
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(other_model_dir).eval()
    url = servers["keyed"].url
    sglang = SGLangEngine(url, api_key=API_KEY)
    vllm = VLLMEngine(url, api_key=API_KEY)
    before = await sglang.generate(PROMPT, GREEDY)
    assert list(before.output_ids) == greedy_reference(ref_model, PROMPT, 10)
    await sglang.update_weights_from_disk(str(other_model_dir), "1")
    after = await sglang.generate(PROMPT, GREEDY)
    assert list(after.output_ids) == greedy_reference(other, PROMPT, 10)
    assert after.output_ids != before.output_ids
    assert after.weight_version == "1" and await vllm.weight_version() == "1"
    await vllm.update_weights_from_disk(str(tiny_model_dir), "2")
    back = await vllm.generate(PROMPT, GREEDY)
    assert back.output_ids == before.output_ids and back.weight_version == "2"
    assert await sglang.weight_version() == "2"
    with pytest.raises(EngineRequestError, match="model_path"):
        await sglang.update_weights_from_disk("/nonexistent/ckpt", "3")
    assert await sglang.weight_version() == "2"
    await sglang.aclose()
    await vllm.aclose()


async def test_pool_of_two_loses_no_request_when_one_is_killed(servers, ref_model) -> None:
    options = HttpOptions(max_retries=2, backoff_s=0.05, timeout_s=60)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    expected = greedy_reference(ref_model, PROMPT, 24)
    doomed = servers["spare"]
    engines = [SGLangEngine(servers["main"].url, options=options)]
    engines.append(SGLangEngine(doomed.url, options=options))
    pool = EnginePool(engines, health_interval_s=1.0)
    results: list = []

    async def one() -> None:
        results.append(await pool.generate(PROMPT, sampling))

    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(one)
        with trio.fail_after(30):  # kill while it runs one, or once all are answered (a slow
            # box can finish the doomed engine's share between two polls of its load)
            while len(results) < 12 and (await engines[1].load()).running == 0:
                await trio.sleep(0.005)
        await trio.to_thread.run_sync(doomed.kill)
    assert len(results) == 12
    assert all(list(c.output_ids) == expected for c in results)
    # marked down by a failed request, or (when every request it held had finished before the
    # kill: a loaded box) by the next health check
    await pool.check_health()
    assert pool.up == [True, False]
    await pool.aclose()
