from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import trio

from rollouts.types import (
    ImmediateTrainFuture,
    RolloutBatch,
    Sample,
    Status,
    TrainBatch,
    TrainFuture,
    only_0_and_1,
    sample_from_dict,
    sample_to_dict,
)


def _sample(**kw) -> Sample:
    base = dict(
        index=0,
        group_index=0,
        prompt="p",
        tokens=(5, 6, 7, 8),
        loss_mask=(0, 0, 1, 1),
        response_length=2,
        rollout_logprobs=(-0.1, -0.2),
        status=Status.COMPLETED,
        weight_versions=("1", "2"),
    )
    base.update(kw)
    return Sample(**base)


def test_sample_invariants() -> None:
    s = _sample()
    assert s.prompt_tokens == (5, 6)
    assert s.response_tokens == (7, 8)
    assert s.weight_version == "2"
    with pytest.raises(AssertionError, match=r"len\(self.tokens\)=4 != len\(self.loss_mask\)=3"):
        _sample(loss_mask=(0, 1, 1))
    with pytest.raises(AssertionError, match="rollout_logprobs"):
        _sample(rollout_logprobs=(-0.1,))
    with pytest.raises(AssertionError, match="response_length"):
        _sample(response_length=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reward = 1.0  # type: ignore[misc]
    with pytest.raises(AssertionError, match="loss_mask values must be 0 or 1"):
        _sample(loss_mask=(0, 0, 1, 2))


def test_a_mask_of_0s_and_1s_is_told_as_a_set_tells_it() -> None:
    for mask in [(), (0, 1, True, False), (1.0, 0.0), (0, 2), (0, -1), (0, 256), (0.5,), (1, "1")]:
        assert only_0_and_1(mask) == (set(mask) <= {0, 1}), mask


def test_a_loss_mask_is_checked_once_per_tuple(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage derives a sample from the last one with the same mask tuple: told once; a new
    tuple, or a list (which can change), is told again, and a bad one is still refused."""
    import rollouts.types as types

    told: list[int] = []
    real = types.only_0_and_1
    monkeypatch.setattr(types, "only_0_and_1", lambda m: told.append(len(m)) or real(m))
    monkeypatch.setattr(types, "MASKS_KEPT", 2)
    monkeypatch.setattr(types, "_CHECKED_MASKS", {})
    s = _sample(loss_mask=(0, 0, 1, 1))
    for reward in (0.0, 1.0, 0.5):
        s = dataclasses.replace(s, reward=reward)
    assert len(told) == 1
    _sample(loss_mask=(0, 1, 1, 1))
    _sample(loss_mask=[0, 0, 1, 1])
    _sample(loss_mask=[0, 0, 1, 1])
    assert len(told) == 4
    with pytest.raises(AssertionError, match="loss_mask values must be 0 or 1"):
        _sample(loss_mask=(0, 0, 1, 2))
    assert len(types._CHECKED_MASKS) <= 2  # at most MASKS_KEPT kept
    monkeypatch.setattr(types, "MASK_TOKENS_KEPT", 6)  # and at most about this many tokens
    for ones in range(1, 5):
        _sample(loss_mask=(0,) * (4 - ones) + (1,) * ones)
    assert sum(map(len, types._CHECKED_MASKS.values())) <= 6 + 4


def test_sample_dict_round_trip() -> None:
    s = _sample(prompt=({"role": "user", "content": "x"},), reward=(1.0, 0.5), label="4")
    assert sample_from_dict(sample_to_dict(s)) == s


def test_rollout_batch_groups() -> None:
    a, b = _sample(), _sample(group_index=1)
    batch = RolloutBatch(groups=((a,), (b,)))
    assert batch.samples == (a, b)
    with pytest.raises(AssertionError, match="mixes group_index"):
        RolloutBatch(groups=((a, b),))


def test_train_batch_select_keeps_global_normalisers() -> None:
    ids = tuple(torch.arange(n) for n in (3, 4, 5))
    mask = tuple(torch.ones(n) for n in (3, 4, 5))
    batch = TrainBatch(input_ids=ids, loss_mask=mask, advantages=mask, num_global_tokens=12.0)
    sub = batch.select([2, 0])
    assert len(sub) == 2
    assert sub.input_ids[0].shape == (5,)
    assert sub.num_global_tokens == 12.0
    with pytest.raises(AssertionError, match="advantages"):
        TrainBatch(input_ids=ids, loss_mask=mask, advantages=mask[:2])


def test_train_batch_to_moves_every_per_token_tensor_and_keeps_the_rest() -> None:
    # the trainer hands a loss function its micro-batch on the model's device: the SFT loss
    # multiplied CUDA logprobs by a CPU mask on the first GPU run
    ids = tuple(torch.arange(n) for n in (3, 4))
    mask = tuple(torch.ones(n) for n in (3, 4))
    batch = TrainBatch(
        input_ids=ids,
        loss_mask=mask,
        advantages=mask,
        old_logprobs=mask,
        num_global_tokens=7.0,
        metadata={"k": 1},
    )
    moved = batch.to("meta")
    for name in ("input_ids", "loss_mask", "advantages", "old_logprobs"):
        assert all(t.device.type == "meta" for t in getattr(moved, name)), name
    assert moved.ref_logprobs == ()
    assert (moved.num_global_tokens, moved.metadata) == (7.0, {"k": 1})
    assert batch.to("cpu").input_ids[0] is ids[0]  # no copy where it already is


async def test_train_future_awaited_under_trio() -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = TrainFuture(pool.submit(lambda: (time.sleep(0.2), 42)[1]))
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while not future.done():
                ticks += 1
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            assert await future == 42
        assert ticks > 3  # the event loop kept running while the work ran in a thread
    assert await ImmediateTrainFuture("x") == "x"
    assert ImmediateTrainFuture(3).result() == 3


async def test_train_future_propagates_errors() -> None:
    import concurrent.futures

    def boom() -> None:
        raise RuntimeError("step failed")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = TrainFuture(pool.submit(boom))
        with pytest.raises(RuntimeError, match="step failed"):
            await future


def test_a_train_batch_of_views_pickles_each_field_once() -> None:
    """make_train_batch's fields are views of one buffer each; torch alone would pickle the
    whole buffer once per view (100 sequences: 100x the bytes), as the FSDP mirror's
    broadcast does with whatever it is given."""
    import pickle

    from rollouts.algorithms.batch import make_train_batch

    samples = [
        Sample(
            index=i,
            group_index=i // 4,
            prompt="p",
            tokens=tuple(range(50 + i)),
            loss_mask=(0,) * 10 + (1,) * (40 + i),
            response_length=40 + i,
            rollout_logprobs=tuple(-0.01 * t for t in range(40 + i)),
            reward=1.0,
            status=Status.COMPLETED,
        )
        for i in range(100)
    ]
    batch = make_train_batch(samples, [torch.full((50 + i,), 0.5) for i in range(100)])
    assert batch.input_ids[0]._base is batch.input_ids[99]._base
    data = sum(
        t.numel() * t.element_size()
        for f in (batch.input_ids, batch.loss_mask, batch.advantages, batch.rollout_logprobs)
        for t in f
    )
    raw = pickle.dumps(batch)
    assert len(raw) < 1.2 * data, (len(raw), data)
    back = pickle.loads(raw)
    for name in ("input_ids", "loss_mask", "advantages", "rollout_logprobs"):
        for a, b in zip(getattr(batch, name), getattr(back, name), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.num_global_tokens == batch.num_global_tokens == sum(40 + i for i in range(100))
