"""Use a reward function written for verl as a `RewardFn`.

verl calls `compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`
and takes a float, or a dict whose "score" key is the reward (other keys are verl's extra logs,
dropped here). `verl_reward(fn)` maps a Sample onto that call: solution_str is the decoded
response (`metadata["response_text"]`, filled by the rollout driver), ground_truth the label,
data_source `metadata[data_source_key]` ("" when absent), extra_info the sample's metadata.
Arguments are passed by keyword, as verl does; a function without an `extra_info` parameter
(and no **kwargs) is called without it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rollouts.plugins import PluginError, is_async_callable, load_function
from rollouts.types import Sample

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


class VerlComputeScore(Protocol):
    """verl's reward function signature (extra_info is optional)."""

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any) -> Any: ...


def _accepts_extra_info(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can take `extra_info=` (a named parameter or **kwargs); checks the names."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [n for n in VERL_PARAMS if n not in params]
    if missing and not var_kw:
        raise PluginError(
            f"{getattr(fn, '__qualname__', fn)!r}: a verl compute_score is called with keywords "
            f"{VERL_PARAMS} (+ extra_info); it has no parameter(s) {missing}"
        )
    return "extra_info" in params or var_kw


def verl_score(result: Any, name: str = "compute_score") -> float:
    """The reward in a verl result: a number (bools count 0/1) or a dict's "score"."""
    value = result
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(
                f"{name} returned a dict without a 'score' key (keys: {sorted(result)}): verl "
                "reward dicts must hold the reward under 'score'"
            )
        value = result["score"]
    try:
        score = float(value)  # int, float, bool, numpy / torch scalars
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} returned {result!r}: expected a number or a dict with a numeric 'score'"
        ) from e
    if not math.isfinite(score):
        raise ValueError(f"{name} returned a non-finite score {result!r}")
    return score


def _call_args(sample: Sample, data_source_key: str, with_extra: bool) -> dict[str, Any]:
    text = sample.metadata.get("response_text")
    if not isinstance(text, str):
        raise ValueError(
            f"sample {sample.index}: a verl reward needs the response text in "
            "metadata['response_text'] (the rollout driver fills it); it is missing"
        )
    kwargs: dict[str, Any] = {
        "data_source": sample.metadata.get(data_source_key, ""),
        "solution_str": text,
        "ground_truth": sample.label,
    }
    if with_extra:
        kwargs["extra_info"] = dict(sample.metadata)
    return kwargs


def verl_reward(
    fn_or_dotted_path: str | Callable[..., Any], data_source_key: str = "data_source"
) -> Callable[[Sample], Any]:
    """A RewardFn `(sample) -> float` that calls a verl-style `compute_score` (sync or async)."""
    fn = load_function(fn_or_dotted_path, VerlComputeScore)
    name = str(fn_or_dotted_path) if isinstance(fn_or_dotted_path, str) else fn.__qualname__
    with_extra = _accepts_extra_info(fn)

    if is_async_callable(fn):

        async def score_async(sample: Sample) -> float:
            result = await fn(**_call_args(sample, data_source_key, with_extra))
            return verl_score(result, name)

        return score_async

    def score(sample: Sample) -> float:
        return verl_score(fn(**_call_args(sample, data_source_key, with_extra)), name)

    return score
