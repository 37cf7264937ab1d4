"""Control calls have their own connection pool: an async-mode weight sync (pause keep ->
reload -> resume) goes through while generations fill the client's whole generation pool.

With one shared pool, the pause froze the generations holding every connection and the reload
waited for one of them: a deadlock until the request timeout (issue 11's stalled async runs).
"""

from __future__ import annotations

from pathlib import Path

import trio

from rollouts.inference.http import HttpOptions, shard_sizes
from rollouts.inference.sglang import SGLangEngine
from rollouts.wire.generation import FinishReason, SamplingParams

LONG = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)


async def test_weight_sync_is_not_stuck_behind_a_full_generation_pool(
    servers, tiny_model_dir: Path
) -> None:
    engine = SGLangEngine(servers["main"].url, options=HttpOptions(max_connections=2))
    done: list = []

    async def generate() -> None:
        done.append(await engine.generate([5, 6, 7], LONG))

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3):  # 2 hold both generation connections, 1 waits for one
                nursery.start_soon(generate)
            with trio.fail_after(30):
                while (await engine.load()).running < 2:
                    await trio.sleep(0.005)
                await engine.pause("keep")
                assert await engine.health()
                await engine.update_weights_from_disk(str(tiny_model_dir), "default")
                await engine.resume()
    finally:
        await engine.aclose()
    assert [c.finish_reason for c in done] == [FinishReason.LENGTH] * 3


def test_generation_pool_is_split_into_small_shards() -> None:
    assert shard_sizes(256, 16) == [16] * 16
    assert shard_sizes(40, 16) == [16, 16, 8]
    assert shard_sizes(2, 16) == [2]
