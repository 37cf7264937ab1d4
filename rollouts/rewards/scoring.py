"""Time-bounded scoring of finished samples with a user reward function.

A reward function that raises, times out, or returns something that is not a reward (None, a
string, NaN, an infinity) marks that sample FAILED with the error in `metadata["error"]`, which
names the function, and its reason in `metadata["failure"]` (`rollouts.failures`): it is
counted and never trained on, never a silent 0 (verl PR #5635). Training (the rollout manager)
and evaluation score through `score_sample`, so a bad reward is treated the same in both. Sync
functions run in a worker thread under `trio.fail_after` (abandoned on timeout: a hung verifier
cannot hang the loop); async ones are awaited under the same bound. Sync reward functions get
their own pool of worker threads (per trio run, `REWARD_THREADS` at most), so abandoned hung
verifiers can never use up trio's default threads, which checkpoints and the backend need.
Records are never mutated: `dataclasses.replace` only.

A sync function's calls are timed (`CallTimes`): once its last FAST_WINDOW calls each took under
FAST_CALL_S, a group is scored in one hop, its calls one after another (`_score_in_one_hop`). An
exact-match verifier takes microseconds, one that decodes and parses a long answer a few ms, and a
thread hop costs about 120-150 us of the driver's CPU a sample; 16 calls of FAST_CALL_S fit in one
hop's HOP_BUDGET_S. (At 1 ms, a sixth to a quarter of the driver bench's 8k-sample step went a
hop a sample: calls that decode a long answer beside a busy driver thread took 1-2 ms.) That hop
starts no call after HOP_BUDGET_S and waits HOP_BUDGET_S + timeout for the last one, so a call
that hangs there still runs at least its timeout before its sample fails; the samples after it
are scored one hop each, and the function is slow again until FAST_WINDOW fast calls are seen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from rollouts.failures import mark_failed
from rollouts.plugins import dotted_name, is_async_callable
from rollouts.rewards.protocol import RewardServiceUnavailable, RewardUnparsed
from rollouts.types import Reward, Sample, Status

SCORABLE = (Status.COMPLETED, Status.TRUNCATED)
REWARD_THREADS = 64  # sync reward calls in flight per trio run (hung ones included)
_REWARD_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("rewards")


def reward_limiter() -> trio.CapacityLimiter:
    """This trio run's limiter of sync reward threads (made on first use)."""
    try:
        return _REWARD_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(REWARD_THREADS)
        _REWARD_LIMITER.set(limiter)
        return limiter


REAL_KINDS = "biuf"  # numpy dtype kinds of real numbers: bool, signed and unsigned int, float
EXPECTED = (
    "expected a float (or another real scalar: int, bool, a numpy scalar, a 0-d numpy array "
    "or torch tensor) or a tuple of them"
)


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    shape = getattr(value, "shape", None)
    return f"{name} of shape {tuple(shape)}" if shape is not None and len(shape) > 0 else name


def _torch_scalar(value: Any) -> Any:
    """A 0-d real torch tensor's Python number, else None (torch is never imported here:
    a tensor exists only when its module is loaded)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if value.ndim != 0 or value.is_complex():
        return None
    return value.item()


def as_scalar(value: Any) -> float:
    """`value` as a float when it is a real scalar: a Python bool/int/float, a numpy scalar
    (np.float32, np.int64, np.bool_, ...), a 0-d real numpy array or a 0-d torch tensor."""
    if isinstance(value, bool | int | float):
        return float(value)
    numpy_real = isinstance(value, np.generic | np.ndarray) and value.dtype.kind in REAL_KINDS
    if numpy_real and value.ndim == 0:
        return float(value.item())
    item = _torch_scalar(value)
    if isinstance(item, bool | int | float):
        return float(item)
    raise TypeError(f"returned {value!r:.80} (a {_type_name(value)}): {EXPECTED}")


def as_reward(value: Any) -> Reward:
    """`value` as a Reward (float, or tuple of floats); raise TypeError/ValueError otherwise.

    Every real scalar counts (`as_scalar`): a bool is 0.0 / 1.0 (`return answer == label`),
    numpy and 0-d torch values too; a string such as "1.0", None or an array of several
    values is an error that names the type.
    """
    if isinstance(value, tuple | list):
        if not value:
            raise TypeError(f"returned an empty {type(value).__name__}: {EXPECTED}")
        out: Reward = tuple(as_scalar(v) for v in value)
        items = out
    else:
        out = as_scalar(value)
        items = (out,)
    if not all(math.isfinite(v) for v in items):
        raise ValueError(f"returned a non-finite reward {value!r}")
    return out


FAST_CALL_S = 0.005  # a sync reward call this quick is not worth a thread hop of its own
FAST_WINDOW = 32  # ... once this many calls in a row were
HOP_BUDGET_S = 0.1  # a group's hop starts no call after this


class CallTimes:
    """How many of a sync reward function's calls in a row took under FAST_CALL_S (counted from
    worker threads: a lost update under a race only delays or ends a fast streak)."""

    def __init__(self) -> None:
        self.streak = 0

    def record(self, seconds: float) -> None:
        self.streak = self.streak + 1 if seconds < FAST_CALL_S else 0

    @property
    def fast(self) -> bool:
        return self.streak >= FAST_WINDOW


_CALL_TIMES: dict[Any, CallTimes] = {}


def call_times(reward_fn: Callable[[Sample], Any]) -> CallTimes:
    """The call times of `reward_fn` (a fresh record for one that cannot be a dict key)."""
    try:
        times = _CALL_TIMES.get(reward_fn)
    except TypeError:  # unhashable: never fast
        return CallTimes()
    if times is None:
        if len(_CALL_TIMES) > 256:  # reward functions made per call: keep the dict small
            _CALL_TIMES.clear()
        times = _CALL_TIMES[reward_fn] = CallTimes()
    return times


def _timed(reward_fn: Callable[[Sample], Any], times: CallTimes, sample: Sample) -> Any:
    start = time.perf_counter()
    try:
        return reward_fn(sample)
    finally:  # a call that raises took its time too
        times.record(time.perf_counter() - start)


async def _call(reward_fn: Callable[[Sample], Any], sample: Sample) -> Any:
    if is_async_callable(reward_fn):
        return await reward_fn(sample)
    call = functools.partial(_timed, reward_fn, call_times(reward_fn), sample)
    return await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=reward_limiter())


async def score_sample(
    sample: Sample, reward_fn: Callable[[Sample], Any], timeout_s: float
) -> Sample:
    """The sample with its reward, or FAILED (error in metadata) on raise, timeout or bad value.

    Samples that are not COMPLETED or TRUNCATED (failed, aborted, pending) come back unchanged.
    """
    assert timeout_s > 0, f"{timeout_s=} must be > 0"
    if sample.status not in SCORABLE:
        return sample
    try:
        with trio.fail_after(timeout_s):
            value = await _call(reward_fn, sample)
    except trio.TooSlowError:
        return _timed_out(sample, reward_fn, timeout_s)
    except Exception as e:  # a user function: any error is that sample's error
        return _judged(sample, reward_fn, None, e)
    return _judged(sample, reward_fn, value, None)


def _timed_out(sample: Sample, reward_fn: Callable[[Sample], Any], timeout_s: float) -> Sample:
    name = _name(reward_fn)
    return mark_failed(sample, f"{name} timed out after {timeout_s} s", "reward/timed_out")


def _judged(
    sample: Sample, reward_fn: Callable[[Sample], Any], value: Any, error: Exception | None
) -> Sample:
    """The sample with the reward `value`, or FAILED by `error` or by a value that is no
    reward; `RewardServiceUnavailable` is raised (the judge's engines are gone: the batch is
    lost, not this sample)."""
    if isinstance(error, RewardServiceUnavailable):
        raise error
    if isinstance(error, RewardUnparsed):
        return mark_failed(sample, f"{_name(reward_fn)}: {error}", "reward/unparsed")
    if error is not None:
        name = _name(reward_fn)
        return mark_failed(
            sample, f"{name} raised {type(error).__name__}: {error}", "reward/raised"
        )
    try:
        return dataclasses.replace(sample, reward=as_reward(value))
    except TypeError as e:
        return mark_failed(sample, f"{_name(reward_fn)} {e}", "reward/not_a_reward")
    except ValueError as e:  # NaN or an infinity (`as_reward`)
        return mark_failed(sample, f"{_name(reward_fn)} {e}", "reward/non_finite")


def _name(reward_fn: Callable[[Sample], Any]) -> str:
    """How an error names the reward function (made only for an error: a sample scored well
    never pays for it)."""
    return f"reward_fn {dotted_name(reward_fn)}"


async def score_group(
    group: Sequence[Sample],
    reward_fn: Callable[[Sample], Any],
    timeout_s: float,
    limiter: trio.CapacityLimiter | None = None,
) -> tuple[Sample, ...]:
    """Score every sample of a group concurrently (at most `limiter` at once), in order, or,
    for a sync function whose calls are fast, one after another in one worker-thread hop;
    `RewardServiceUnavailable` (a judge with no engine left) stops the group and is raised."""
    if limiter is None and not is_async_callable(reward_fn) and call_times(reward_fn).fast:
        return await _score_in_one_hop(group, reward_fn, timeout_s)
    out: list[Sample | None] = [None] * len(group)
    lost: list[RewardServiceUnavailable] = []

    async def one(i: int, sample: Sample, scope: trio.CancelScope) -> None:
        try:
            if limiter is None:
                out[i] = await score_sample(sample, reward_fn, timeout_s)
                return
            async with limiter:
                out[i] = await score_sample(sample, reward_fn, timeout_s)
        except RewardServiceUnavailable as e:
            lost.append(e)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        for i, sample in enumerate(group):
            nursery.start_soon(one, i, sample, nursery.cancel_scope)
    if lost:
        raise lost[0]
    assert all(s is not None for s in out), "a sample was not scored"
    return tuple(s for s in out if s is not None)


def count_failed(samples: Sequence[Sample]) -> int:
    """How many samples are FAILED (report it every step)."""
    return sum(1 for s in samples if s.status is Status.FAILED)


async def _score_in_one_hop(
    group: Sequence[Sample], reward_fn: Callable[[Sample], Any], timeout_s: float
) -> tuple[Sample, ...]:
    """`score_group` of a fast sync function: its calls one after another in one worker thread
    (see the module doc); what that hop did not score goes through `score_group` again."""
    todo = [i for i, s in enumerate(group) if s.status in SCORABLE]
    times, lock = call_times(reward_fn), threading.Lock()
    done: dict[int, tuple[Any, Exception | None]] = {}
    state = {"stop": False, "current": -1}

    def run() -> None:
        start = time.perf_counter()
        for i in todo:
            with lock:
                if state["stop"] or time.perf_counter() - start > HOP_BUDGET_S:
                    return
                state["current"] = i
            began = time.perf_counter()
            try:
                result: tuple[Any, Exception | None] = (reward_fn(group[i]), None)
            except Exception as e:  # judged on the trio side, as `score_sample` does
                result = (None, e)
            times.record(time.perf_counter() - began)
            with lock:
                done[i] = result

    with trio.move_on_after(HOP_BUDGET_S + timeout_s) as scope:
        await trio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=reward_limiter())
    with lock:  # from here the hop starts no call, and what it finishes later is not read
        state["stop"] = True
        scored, current = dict(done), state["current"]
    out = list(group)
    # a call in progress when the hop's time ran out (none if its thread never got to run)
    hung = current if scope.cancelled_caught and current >= 0 and current not in scored else None
    if hung is not None:  # it started by HOP_BUDGET_S, so it ran at least its timeout
        times.record(timeout_s)
        out[hung] = _timed_out(group[hung], reward_fn, timeout_s)
    for i, (value, error) in scored.items():
        out[i] = _judged(group[i], reward_fn, value, error)
    rest = [i for i in todo if i not in scored and i != hung]
    if rest:  # the hop's budget ran out, or a call hung: one hop a sample again
        again = await score_group([group[i] for i in rest], reward_fn, timeout_s)
        for i, sample in zip(rest, again, strict=True):
            out[i] = sample
    return tuple(out)
