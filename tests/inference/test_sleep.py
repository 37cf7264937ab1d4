"""The built-in engine asleep (issue 29, item 1): vLLM's /sleep, /wake_up, /is_sleeping and
SGLang's /release_memory_occupation, /resume_memory_occupation on a real server, through both
clients and the pool. Asleep, requests wait; a level-2 sleep discards the weights and nothing is
served until they are reloaded; the answers after a wake-up equal those before the sleep."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from rollouts.driver.memory import rss_mb
from rollouts.engine.launch import engine_process, engine_server
from rollouts.inference.http import EngineError
from rollouts.inference.pool import EnginePool
from rollouts.inference.protocol import Sleeper
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.vllm import VLLMEngine
from rollouts.weights.disk import DiskDelivery
from rollouts.wire.generation import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
PROMPT = [5, 9, 2, 7]


async def _post(url: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(path, **kwargs)


async def _sleeping(url: str) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get("/is_sleeping")).json()["is_sleeping"]


async def test_vllm_sleep_levels_on_the_builtin_engine(tiny_model_dir: Path) -> None:
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        engine = VLLMEngine(url)
        assert isinstance(engine, Sleeper)
        before = (await engine.generate(PROMPT, GREEDY)).output_ids
        probe = await engine.prompt_logprobs(PROMPT + list(before))

        # level 1: a request sent while asleep waits for the wake-up, then answers the same
        answer = await _post(url, "/sleep", params={"level": "1"})
        assert answer.json() == {"status": "sleeping", "level": 1}
        assert await _sleeping(url)
        got: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(got, engine.generate(PROMPT, GREEDY)))
            await trio.sleep(0.5)
            assert got == []  # held while asleep
            answer = await _post(url, "/wake_up")
            assert answer.json() == {"status": "awake", "tags": None}
        assert got[0].output_ids == before and not await _sleeping(url)

        # level 2: the weights are gone; a partial wake-up (weights) lets them be reloaded
        await engine.sleep(2)
        answer = await _post(url, "/wake_up", params={"tags": "weights"})
        assert answer.json() == {"status": "sleeping", "tags": ["weights"]}
        with pytest.raises(EngineError, match="level-2 sleep discarded the weights"):
            await engine.prompt_logprobs(PROMPT)
        await engine.update_weights_from_disk(str(tiny_model_dir), "1")
        answer = await _post(url, "/wake_up", params={"tags": ["kv_cache", "scheduling"]})
        assert answer.json()["status"] == "awake"
        assert (await engine.generate(PROMPT, GREEDY)).output_ids == before
        assert await engine.prompt_logprobs(PROMPT + list(before)) == probe

        # the client's own cycle; a level-2 wake-up without a reload serves nothing
        await engine.sleep(2)
        await engine.wake_up()
        with pytest.raises(EngineError, match="reload them before generating"):
            await engine.generate(PROMPT, GREEDY)
        await engine.update_weights_from_disk(str(tiny_model_dir), "2")
        assert (await engine.generate(PROMPT, GREEDY)).output_ids == before
        await engine.aclose()


async def _append(out: list, call) -> None:
    out.append(await call)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_a_sleep_gives_the_freed_kv_cache_back_to_the_os(tiny_model_dir: Path) -> None:
    """The server keeps freed pages for its next step (`rollouts/heap.py`), so a sleep must
    hand them back itself: the KV cache of 256 rows (about 40 MB here) leaves the RSS."""
    async with engine_process(tiny_model_dir, max_batch=256) as proc:
        engine = VLLMEngine(proc.url)
        long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            for _ in range(256):
                nursery.start_soon(engine.generate, PROMPT, long)
        awake = rss_mb(proc.process.pid)
        await engine.sleep(1)
        asleep = rss_mb(proc.process.pid)
        assert awake is not None and asleep is not None
        assert asleep < awake - 20, f"RSS {awake:.0f} MB awake, {asleep:.0f} MB asleep"
        await engine.aclose()


async def test_asleep_weights_cannot_be_reloaded_and_bad_input_names_the_field(
    tiny_model_dir: Path,
) -> None:
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        answer = await _post(url, "/sleep", params={"level": "3"})
        assert answer.status_code == 400 and "level" in answer.text
        answer = await _post(url, "/sleep", params={"mode": "later"})
        assert answer.status_code == 400 and "mode" in answer.text
        answer = await _post(url, "/wake_up", params={"tags": "gpu"})
        assert answer.status_code == 400 and "'gpu'" in answer.text
        answer = await _post(url, "/release_memory_occupation", json={"tags": "weights"})
        assert answer.status_code == 400 and "tags" in answer.text
        await _post(url, "/sleep", params={"level": "1"})
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}}
        answer = await _post(url, "/collective_rpc", json=rpc)
        assert answer.status_code == 503 and "POST /wake_up first" in answer.text
        await _post(url, "/wake_up")
        assert (await _post(url, "/collective_rpc", json=rpc)).status_code == 200


async def test_sglang_release_and_resume_through_the_client(tiny_model_dir: Path) -> None:
    async with engine_server(tiny_model_dir, weight_version="0", max_batch=4) as url:
        engine = SGLangEngine(url)
        before = (await engine.generate(PROMPT, GREEDY)).output_ids
        # long enough that it still runs when the release is asked (100 tokens finished first
        # once, on a loaded box); the context is 512
        long = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
        async with trio.open_nursery() as nursery:  # SGLang releases only an idle server
            nursery.start_soon(engine.generate, PROMPT, long)
            while (await engine.load()).running == 0:
                await trio.sleep(0.01)
            answer = await _post(url, "/release_memory_occupation", json={})
            assert answer.status_code == 400 and "idle" in answer.text
            await engine.sleep(1)  # pauses (aborting it) first: then the release is taken
        assert await _sleeping(url)
        assert await engine.health()  # liveness while asleep does not generate
        await engine.wake_up()
        with pytest.raises(EngineError, match="level-2 sleep discarded the weights"):
            await engine.prompt_logprobs(PROMPT)  # SGLang's release does not keep the weights
        await engine.update_weights_from_disk(str(tiny_model_dir), "1")
        assert (await engine.generate(PROMPT, GREEDY)).output_ids == before
        await engine.aclose()


async def test_a_pool_asleep_checks_only_liveness_and_serves_again_after_the_sync(
    tiny_model_dir: Path,
) -> None:
    async with engine_server(tiny_model_dir, weight_version="0") as url:
        pool = EnginePool([VLLMEngine(url), VLLMEngine(url)], health_interval_s=0.05)
        pool.set_weights(str(tiny_model_dir), "0")
        before = await pool.generate(PROMPT, GREEDY)
        await pool.sleep(2)
        pool.mark_down(1)  # as a slow health check would, while asleep
        for _ in range(3):
            await pool.check_health()  # the weights are gone: no proof asked; 1 stays down
        assert pool.up == [True, False]
        await pool.wake_up()  # the down one too
        report = await pool.sync(DiskDelivery(path=str(tiny_model_dir), version="1"))
        assert report.ok, report
        await pool.check_health()
        assert pool.up == [True, True]
        for _ in range(2):
            assert (await pool.generate(PROMPT, GREEDY)).output_ids == before.output_ids
        pool.mark_down(0)  # none up (both marked down): nothing to sleep or wake, no error
        pool.mark_down(1)
        await pool.sleep(1)
        await pool.wake_up()
        await pool.aclose()
