"""Test bodies for AsyncRolloutManager, run against the fake engine and the real server.

Each case takes an engine (InferenceEngine) and a tokenizer; the reward functions are written
here so that groups vary or are equal on purpose (the tiny model's output is gibberish).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import trio

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.data.buffer import DataBuffer
from rollouts.rollout.batch import ShortBatchError
from rollouts.rollout.generate import generate_single_turn
from rollouts.rollout.manager import AsyncRolloutManager
from rollouts.types import PromptItem, Sample, Status


def make_buffer(num: int = 32) -> DataBuffer:
    return DataBuffer([PromptItem(index=i, prompt=f"q{i}:") for i in range(num)], shuffle=False)


def make_config(**kw: Any) -> RolloutConfig:
    sampling = SamplingConfig(max_new_tokens=kw.pop("max_new_tokens", 8), temperature=1.0)
    defaults: dict[str, Any] = dict(
        batch_size=2,
        n_samples_per_prompt=3,
        over_sampling_factor=2.0,
        max_concurrency=16,
        max_over_sampling_rounds=4,
        generate_timeout_s=60.0,
        reward_timeout_s=10.0,
    )
    return RolloutConfig(**{**defaults, **kw}, sampling=sampling)


def alternating_reward(constant_groups: Callable[[int], bool]) -> Callable[[Sample], float]:
    """Constant reward for groups where `constant_groups(group_index)`, else 0, 1, 0, ..."""
    calls: collections.Counter[int] = collections.Counter()

    def reward(sample: Sample) -> float:
        calls[sample.group_index] += 1
        if constant_groups(sample.group_index):
            return 1.0
        return float(calls[sample.group_index] % 2)

    return reward


def check_sample(s: Sample, prompt_ids: list[int]) -> None:
    """Every kept sample keeps exact tokens, masks, logprobs, versions and a finished status."""
    assert s.status in (Status.COMPLETED, Status.TRUNCATED)
    assert list(s.tokens[: s.prompt_length]) == prompt_ids
    assert s.loss_mask == (0,) * s.prompt_length + (1,) * s.response_length
    assert len(s.rollout_logprobs) == s.response_length >= 1
    assert all(lp <= 0.0 for lp in s.rollout_logprobs)
    assert s.weight_versions
    assert s.reward is not None


async def groups_of_n_and_surplus_aborted(engine: Any, tok: Any) -> None:
    buffer = make_buffer()
    config = make_config(batch_size=2, n_samples_per_prompt=3, over_sampling_factor=2.0)
    manager = AsyncRolloutManager(
        buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: False)
    )
    batch = await manager.generate_batch()
    assert len(batch.groups) == 2
    for group in batch.groups:
        assert len(group) == 3
        ids = tok(group[0].prompt, add_special_tokens=False)["input_ids"]
        for s in group:
            check_sample(s, ids)
    meta = batch.metadata
    assert meta["submitted_groups"] == 4
    # the 2 surplus groups were aborted (or finished first): both wait in the partial pool
    assert meta["partial_groups_saved"] == 2
    assert buffer.num_partial_groups == 2
    assert meta["drop_reasons"] == {}
    assert meta["num_samples"] == 6
    assert meta["response_length_hist"]["counts"]
    assert meta["tokens_per_s"] > 0
    assert (await engine.load()).total == 0  # the surplus was aborted and drained


async def filter_triggers_extra_sampling(engine: Any, tok: Any) -> None:
    config = make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        filters=["check_reward_nonzero_std"],
    )
    manager = AsyncRolloutManager(make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(alternating_reward(lambda g: g % 2 == 0))
    assert [g[0].group_index for g in batch.groups] == [1, 3]
    assert batch.metadata["drop_reasons"] == {"zero_reward_std": 2}
    # 2 groups, then top-ups of 1 and 1: 4 groups = 2 waves of ceil(2 * 1.0), not 3 rounds
    assert batch.metadata["rounds"] == 2


async def over_sampling_bound_stops(engine: Any, tok: Any) -> None:
    config = make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.5,
        max_over_sampling_rounds=2,
        filters=["check_reward_nonzero_std"],
    )
    manager = AsyncRolloutManager(make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(lambda s: 1.0)  # no Python warning: the driver says it
    assert batch.groups == ()
    assert batch.metadata["short_batch"] is True
    assert "0/2 groups kept after 2" in batch.metadata["short_batch_message"]
    # the bound is 2 waves of ceil(2 * 1.5) = 3 groups, however they were topped up
    assert batch.metadata["drop_reasons"] == {"zero_reward_std": 6}
    strict = make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        max_over_sampling_rounds=1,
        on_short_batch="error",
        filters=["check_reward_nonzero_std"],
    )
    manager = AsyncRolloutManager(make_buffer(), strict, engine, tokenizer=tok)
    with pytest.raises(ShortBatchError, match="rollout.max_over_sampling_rounds"):
        await manager.generate_batch(lambda s: 1.0)


async def raising_fns_are_reported(engine: Any, tok: Any) -> None:
    async def flaky_generate(sample, ctx):
        if sample.group_index == 0:
            raise RuntimeError("user generate_fn broke")
        return await generate_single_turn(sample, ctx)

    def reward(sample: Sample) -> float:
        if sample.group_index == 1:
            raise ValueError("verifier broke")
        return float(sample.response_length % 3)

    config = make_config(batch_size=1, n_samples_per_prompt=2, over_sampling_factor=1.0)
    manager = AsyncRolloutManager(
        make_buffer(), config, engine, tokenizer=tok, generate_fn=flaky_generate
    )
    batch = await manager.generate_batch(reward)
    meta = batch.metadata
    assert [g[0].group_index for g in batch.groups] == [2]
    assert meta["drop_reasons"] == {"failed": 2}
    assert meta["failed_samples"] == 4
    assert any("user generate_fn broke" in e for e in meta["errors"])
    assert any("verifier broke" in e for e in meta["errors"])


async def _batch_cut_mid_generation(
    engine: Any, tok: Any, config: RolloutConfig
) -> tuple[DataBuffer, Any]:
    """A batch aborted from outside while it generates, and its buffer, such that at least one
    saved partial sample holds tokens: an abort can land before a request's first token (on a
    loaded box), so it is tried again, later in the request each time (bounded)."""
    for delay_s in (0.0, 0.005, 0.01, 0.02, 0.04):
        buffer = make_buffer()
        manager = AsyncRolloutManager(
            buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: False)
        )

        async def abort_once_running(delay_s: float = delay_s) -> None:
            with trio.fail_after(30):
                while (await engine.load()).running == 0:
                    await trio.sleep(0.005)
            await trio.sleep(delay_s)
            await engine.abort_all()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_once_running)
            first = await manager.generate_batch()
        cut = [s for g in buffer._partial for s in g if s.status is Status.ABORTED and s.tokens]
        if cut:
            return buffer, first
    raise AssertionError("no abort cut a request after its first token in 5 tries")


async def partial_resume_and_buffer_state(engine: Any, tok: Any) -> None:
    """Abort mid-generation from outside; the cut groups resume next batch from their tokens."""
    config = make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        max_new_tokens=48,
        max_over_sampling_rounds=8,
    )
    buffer, first = await _batch_cut_mid_generation(engine, tok, config)
    assert first.metadata["aborted_samples"] >= 1
    assert buffer.num_partial_groups >= 1
    # save / restore the buffer (partial groups included) through JSON
    restored = make_buffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored.state_dict() == buffer.state_dict()
    partial = {(s.group_index, i): s for g in restored._partial for i, s in enumerate(g)}
    manager = AsyncRolloutManager(
        restored, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: False)
    )
    second = await manager.generate_batch()
    resumed = 0
    for group in second.groups:
        for i, s in enumerate(group):
            before = partial.get((s.group_index, i))
            if before is None or before.status is not Status.ABORTED:
                continue
            if not before.tokens:  # aborted before its first token (a loaded box): starts over
                assert "resumed_at" not in s.metadata and len(s.weight_versions) <= 1
                continue
            resumed += 1
            assert s.tokens[: len(before.tokens)] == before.tokens  # the right prefix
            assert s.rollout_logprobs[: before.response_length] == before.rollout_logprobs
            assert len(s.weight_versions) == 2 or s.response_length == before.response_length
            assert s.response_length <= 48
            assert s.metadata["resumed_at"] == [before.response_length]
    assert resumed >= 1
    assert second.metadata["resumed_samples"] >= 1


def sync_generate(sample: Sample, ctx: Any) -> Sample:
    """A plain-def generate_fn (runs in a worker thread): a fixed 2-token response."""
    ids = tuple(ctx.tokenizer(str(sample.prompt), add_special_tokens=False)["input_ids"])
    return dataclasses.replace(
        sample,
        tokens=(*ids, 7, 8),
        loss_mask=(0,) * len(ids) + (1, 1),
        response_length=2,
        rollout_logprobs=(-1.0, -1.0),
        weight_versions=("0",),
        status=Status.COMPLETED,
    )


async def sync_generate_fn_by_dotted_path(engine: Any, tok: Any) -> None:
    config = make_config(
        batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_factor=1.0,
        generate_fn="tests.rollout.manager_cases.sync_generate",
    )
    manager = AsyncRolloutManager(make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(alternating_reward(lambda g: False))
    assert all(s.response_tokens == (7, 8) for s in batch.samples)


async def slow_reward_times_out_as_failed(engine: Any, tok: Any) -> None:
    async def reward(sample: Sample) -> float:
        if sample.group_index == 0:
            await trio.sleep_forever()
        return float(sample.response_length % 2) + sample.group_index

    config = make_config(
        batch_size=1, n_samples_per_prompt=1, over_sampling_factor=1.0, reward_timeout_s=5.0
    )
    manager = AsyncRolloutManager(make_buffer(), config, engine, tokenizer=tok)
    batch = await manager.generate_batch(reward)
    assert batch.metadata["drop_reasons"] == {"failed": 1}
    assert any("timed out after" in e for e in batch.metadata["errors"]), batch.metadata["errors"]


async def surplus_is_reused_or_reset(engine: Any, tok: Any) -> None:
    config = make_config(
        batch_size=1, n_samples_per_prompt=2, over_sampling_factor=3.0, max_concurrency=2
    )  # one group at a time: the rest never start
    buffer = make_buffer()
    manager = AsyncRolloutManager(
        buffer, config, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: False)
    )
    first = await manager.generate_batch()
    saved = sorted(g[0].group_index for g in buffer._partial)
    assert sorted([*saved, first.groups[0][0].group_index]) == [0, 1, 2]
    second = await manager.generate_batch()  # serves the 2 saved groups first, then group 3
    assert second.groups[0][0].group_index in (*saved, 3)
    assert second.metadata["submitted_groups"] == 3
    assert first.metadata["unstarted_samples"] + first.metadata.get("aborted_samples", 0) >= 2
    off = dataclasses.replace(config, partial_rollouts=False)
    buffer = make_buffer()
    manager = AsyncRolloutManager(
        buffer, off, engine, tokenizer=tok, reward_fn=alternating_reward(lambda g: False)
    )
    await manager.generate_batch()
    for group in buffer._partial:  # prompts are not lost: restarted from scratch next time
        assert all(s.status is Status.PENDING and not s.tokens for s in group)
