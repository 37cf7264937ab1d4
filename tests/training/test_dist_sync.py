"""Distributed weight sync (SGLang's protocol, gloo over loopback) into real engine processes:
trained weights reach one engine, then two; a refused bucket and a killed engine fail the sync
by name and step, never hang; over the pool, the dead engine is marked down and the survivor
synced in a new group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from rollouts.engine.launch import engine_spec, spawn, wait_healthy_sync
from rollouts.inference.http import HttpOptions
from rollouts.inference.pool import EnginePool
from rollouts.inference.sglang import SGLangEngine
from rollouts.inference.sglang_wire import distributed_update_body
from rollouts.inference.sync import WeightSyncError
from rollouts.weights.distributed import DistributedWeightSync, DistSyncOptions
from rollouts.weights.distributed_pool import DistributedDelivery
from rollouts.wire.generation import SamplingParams
from rollouts.wire.weight_group import broadcast_bucket, flatten, state_specs
from tests.training.backend_helpers import one_torch_thread  # noqa: F401 (autouse)
from tests.training.test_weight_sync import _greedy, _train_to_memorise


async def _greedy_outputs(engines: list[SGLangEngine], prompt: list[int], n: int) -> list:
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    done = [await e.generate(prompt, greedy) for e in engines]
    return [(list(c.output_ids), c.weight_version) for c in done]


async def _send_flattened(
    sync: DistributedWeightSync, engine: SGLangEngine, weights: dict, version: str
) -> str:
    """One bucket in SGLang's "flattened_bucket" format, over the group `sync` formed."""
    assert sync._transport is not None and sync.spec is not None
    group = sync._transport.group
    specs = state_specs(weights)
    body = distributed_update_body(
        specs, group_name=sync.spec.group_name, version=version, flush_cache=True
    )
    body["load_format"] = "flattened_bucket"
    await engine.begin_weight_update()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._weights_call, "/update_weights_from_distributed", body)
        flat = flatten(weights[s.name] for s in specs)
        nursery.start_soon(trio.to_thread.run_sync, broadcast_bucket, group, flat)
    await engine.finish_weight_update(version)
    return await engine.weight_version()


async def test_distributed_sync_into_one_then_two_engines_and_its_failures(
    tiny_model_dir: Path,
) -> None:
    procs = [spawn(engine_spec(str(tiny_model_dir), weight_version="0")) for _ in "ab"]
    try:
        backend, prompt, response = await trio.to_thread.run_sync(
            _train_to_memorise, tiny_model_dir
        )
        trained = _greedy(backend.lm, prompt, len(response))
        assert trained == response  # the trainer memorised the answer
        for proc in procs:
            await trio.to_thread.run_sync(wait_healthy_sync, proc, 120.0)
        http = HttpOptions(max_retries=0, timeout_s=60.0)
        engines = [SGLangEngine(p.url, options=http) for p in procs]
        sync = DistributedWeightSync(DistSyncOptions(bucket_bytes=16 * 1024, timeout_s=60.0))
        before = await _greedy_outputs(engines, prompt, len(trained))
        one = await sync.sync(engines[:1], backend.get_weights, "1", step=1)
        after_one = await _greedy_outputs(engines, prompt, len(trained))
        two = await sync.sync(engines, backend.get_weights, "2", step=2)  # the group re-forms
        after_two = await _greedy_outputs(engines, prompt, len(trained))

        bogus = {**backend.get_weights(), "bogus.weight": torch.zeros(3)}
        with pytest.raises(WeightSyncError, match="at step 3") as refused:
            await sync.sync(engines, lambda: bogus, "3", step=3)  # received, refused: no hang
        versions_after_refusal = [await e.weight_version() for e in engines]
        procs[1].kill()
        with pytest.raises(WeightSyncError, match="at step 4") as killed:
            await sync.sync(engines, backend.get_weights, "4", step=4)
        assert not sync.connected  # dropped after a failure; formed anew next time
        with trio.fail_after(30):  # the survivor was resumed although the dead one's resume failed
            await _greedy_outputs(engines[:1], prompt, 2)
        pool = EnginePool(engines, wait_for_up_s=5.0)  # both "up": the sync finds the dead one
        delivery = DistributedDelivery(
            sender=sync, get_weights=backend.get_weights, version="5", step=5
        )
        survivor = await pool.sync(delivery)
        served = await engines[0].weight_version()
        flattened = await _send_flattened(sync, engines[0], backend.get_weights(), "6")
        await sync.close(engines[:1])
        for engine in engines:
            await engine.aclose()
        backend.close()
    finally:
        for proc in procs:
            proc.stop()
            proc.discard_log()
    assert before[0][0] != trained and before[0][1] == "0"
    assert one.ok and two.ok and two.metrics()["load_s_max"] > 0
    assert after_one == [(trained, "1"), before[1]]
    assert after_two == [(trained, "2"), (trained, "2")]
    assert [r.ok for r in refused.value.report.results] == [False, False]
    assert "names not in the served model: ['bogus.weight']" in str(refused.value)
    assert versions_after_refusal == ["2", "2"]
    results = killed.value.report.results
    assert [r.ok for r in results] == [False, False], str(killed.value)  # none left "ok"
    assert results[1].url == procs[1].url and results[1].error, str(killed.value)
    assert flattened == "6"  # SGLang's flattened_bucket format is read too
    assert survivor.ok and served == "5" and pool.up == [True, False]
    assert survivor.metrics()["engines_down"] == 1.0
    assert pool.weights is not None
    # no file to reload old weights from
    assert (pool.weights.version, pool.weights.path) == ("5", None)
