from __future__ import annotations

from typing import Protocol

import pytest

from rollouts.plugins import PluginError, call_maybe_async, check_signature, load_function
from rollouts.types import Sample


class RewardFnLike(Protocol):
    def __call__(self, sample: Sample) -> float: ...


def good_reward(sample):
    return 1.0


async def async_reward(sample):
    return 2.0


def two_required(sample, extra):
    return 0.0


def with_default(sample, scale=1.0):
    return scale


def no_params():
    return 0.0


NOT_A_FUNCTION = 3


def test_load_by_dotted_path() -> None:
    fn = load_function("tests.test_plugins.good_reward", RewardFnLike)
    assert fn is good_reward
    assert load_function("tests.test_plugins:async_reward", RewardFnLike) is async_reward


def test_load_object_directly() -> None:
    assert load_function(with_default, RewardFnLike) is with_default


def test_bad_module() -> None:
    with pytest.raises(PluginError, match="cannot import module 'tests.nope'"):
        load_function("tests.nope.fn", RewardFnLike)


def test_bad_attribute_lists_what_exists() -> None:
    with pytest.raises(PluginError, match="has no attribute 'good_rewrd'.*good_reward"):
        load_function("tests.test_plugins.good_rewrd", RewardFnLike)


def test_not_a_dotted_path() -> None:
    with pytest.raises(PluginError, match="expected a dotted path"):
        load_function("justaname", RewardFnLike)


def test_wrong_signature_extra_param() -> None:
    with pytest.raises(PluginError, match=r"extra required parameter\(s\) \['extra'\]"):
        load_function("tests.test_plugins.two_required", RewardFnLike)


def test_wrong_signature_too_few() -> None:
    with pytest.raises(PluginError, match="takes 0 parameter"):
        check_signature(no_params, RewardFnLike)


def test_not_callable() -> None:
    with pytest.raises(PluginError, match="is a int, not a function"):
        load_function("tests.test_plugins.NOT_A_FUNCTION", RewardFnLike)


async def test_call_maybe_async_runs_both() -> None:
    sample = Sample(index=0, group_index=0, prompt="p")
    assert await call_maybe_async(good_reward, sample) == 1.0
    assert await call_maybe_async(async_reward, sample) == 2.0
