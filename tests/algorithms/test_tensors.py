"""The array-backed tensor builders match torch.tensor and refuse what it would truncate."""

from __future__ import annotations

import pytest
import torch

from rollouts.algorithms.tensors import (
    float_tensor,
    joined,
    long_tensor,
    long_views,
    mask_tensor,
    mask_views,
    row_sums,
)


def test_same_values_and_dtypes_as_torch_tensor() -> None:
    ids = (3, 0, 2**40, -1)
    assert torch.equal(long_tensor(ids), torch.tensor(ids, dtype=torch.long))
    assert long_tensor(ids).dtype == torch.int64
    mask = (0, 1, 1, True)
    assert torch.equal(float_tensor(mask), torch.tensor(mask, dtype=torch.float32))
    logprobs = (-0.25, -1.5e-8, -30.0)
    assert torch.equal(float_tensor(logprobs), torch.tensor(logprobs, dtype=torch.float32))
    assert long_tensor(()).shape == (0,) and float_tensor([]).dtype == torch.float32


def test_each_tensor_owns_its_memory() -> None:
    a, b = long_tensor((1, 2)), long_tensor((1, 2))
    a[0] = 7
    assert b.tolist() == [1, 2]
    a.add_(1)  # writable, like torch.tensor's result
    assert a.tolist() == [8, 3]


def test_a_float_token_id_is_an_error_not_a_truncation() -> None:
    with pytest.raises(TypeError):
        long_tensor((1, 2.5))


def test_a_mask_as_bytes_is_the_same_tensor_as_float_tensor() -> None:
    for mask in [(0, 1, 1, True, 0), (1,) * 3000, (0, 2, 255), (0.0, 1.0, 1.0), (0, -1, 256)]:
        got = mask_tensor(mask)
        assert got.dtype == torch.float32
        assert torch.equal(got, float_tensor(mask)), mask  # floats and non-bytes: float_tensor
    assert mask_tensor(()).shape == (0,) and mask_tensor(()).dtype == torch.float32
    a = mask_tensor((0, 1))
    a.add_(1)  # writable and its own
    assert a.tolist() == [1.0, 2.0]


def test_the_same_bits_as_packing_into_an_array() -> None:
    import array
    import random

    import numpy as np

    rng = random.Random(0)
    floats = [rng.gauss(0.0, 10.0) for _ in range(500)] + [1e-45, -0.0, 3.4e38, 1e300, -1e300]
    floats += [float("inf"), 7, True, np.float64(0.1), np.float32(0.3), 2**200]
    got = float_tensor(floats)
    want = torch.frombuffer(array.array("f", floats), dtype=torch.float32)  # past float32: inf
    assert got.view(torch.int32).tolist() == want.view(torch.int32).tolist()
    ids = [rng.randrange(-(2**63), 2**63) for _ in range(500)] + [True, np.int64(5), np.int32(-3)]
    assert long_tensor(ids).tolist() == array.array("q", ids).tolist()
    for bad in [(1, 2**63), (1, "2"), (1, None), (1, np.float64(2.0))]:
        with pytest.raises((TypeError, OverflowError)) as got_error:
            long_tensor(bad)
        with pytest.raises(type(got_error.value), match=str(got_error.value)):
            array.array("q", bad)
    with pytest.raises(TypeError):
        float_tensor((0.5, "x"))


def test_views_of_one_buffer_are_the_tensors_made_one_by_one() -> None:
    seqs = [(5, 2**40, -1), (), (7,), tuple(range(300))]
    got = long_views(seqs)
    assert all(torch.equal(g, long_tensor(s)) for g, s in zip(got, seqs, strict=True))
    assert got[0]._base is got[3]._base  # one buffer
    masks = [(0, 1, True), (), (1,) * 40, (0, 0)]
    assert all(
        torch.equal(g, mask_tensor(m)) for g, m in zip(mask_views(masks), masks, strict=True)
    )
    for odd in [[(0, 1.0), (1,)], [(0, 2, 255), (0, -1)]]:  # floats, non-bytes: one by one
        assert all(
            torch.equal(g, mask_tensor(m)) for g, m in zip(mask_views(odd), odd, strict=True)
        )
    assert [v.shape for v in mask_views([(), ()])] == [(0,), (0,)]
    with pytest.raises(TypeError):
        long_views([(1, 2), (3, 2.5)])


def test_joined_views_are_their_buffer_and_anything_else_a_cat() -> None:
    views = long_views([(1, 2), (3,), (), (4, 5, 6)])
    whole = joined(views)
    assert whole.tolist() == [1, 2, 3, 4, 5, 6] and whole.data_ptr() == views[0].data_ptr()
    middle = joined(views[1:])
    assert middle.tolist() == [3, 4, 5, 6] and middle.data_ptr() == views[1].data_ptr()
    for parts in [(views[3], views[0]), (views[0], views[3]), (views[0], long_tensor((9,)))]:
        got = joined(parts)  # out of order, a gap, another buffer: copied
        assert torch.equal(got, torch.cat(parts)) and got.data_ptr() != views[0].data_ptr()
    assert torch.equal(joined([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))


def test_row_sums_are_each_rows_sum() -> None:
    rows = [torch.ones(3), torch.zeros(0), torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.ones(5000)]
    assert row_sums(rows) == [float(r.sum()) for r in rows]
    views = mask_views([(0, 1, 1), (), (1,) * 70])
    assert row_sums(views) == [2.0, 0.0, 70.0] and row_sums([]) == []
