"""The array-backed tensor builders match torch.tensor and refuse what it would truncate."""

from __future__ import annotations

import pytest
import torch

from rollouts.algorithms.tensors import float_tensor, long_tensor, mask_tensor


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
