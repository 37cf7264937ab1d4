"""math_reward: math-verify's verdicts through real worker processes, and what fails a sample: a
gold it cannot parse, an error inside it, a hung verification (killed at the timeout), a worker
killed mid-request; the short name `rollout.reward_fn = "math"`."""

from __future__ import annotations

import os
import signal

import pytest
import trio
from math_verify import parse

from rollouts.plugins import PluginError
from rollouts.rewards.math_answer import (
    WORKERS_ENV,
    MathVerifyError,
    gold_answer,
    math_pool,
    math_reward,
    reward_from_reply,
)
from rollouts.rewards.math_worker import HANG_ENV, grade
from rollouts.rewards.named import MissingExtra, load_reward_fn, require_module
from rollouts.rewards.scoring import score_group, score_sample
from rollouts.types import Sample, Status

HANG = "a response the worker hangs on"
GSM8K = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips. #### 72"
# (response, label, reward)
VERDICTS = [
    ("The answer is 72.", "72", 1.0),
    ("The answer is 73.", "72", 0.0),
    ("So she sold 72 clips in all.", GSM8K, 1.0),
    ("So she sold 70 clips in all.", GSM8K, 0.0),
    ("The answer is 0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("The answer is 0.6", "\\boxed{\\frac{1}{2}}", 0.0),
    ("Hence $\\frac{3}{4}$.", "\\frac{3}{4}", 1.0),
    ("Hence $\\frac{3}{5}$.", "\\frac{3}{4}", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("It costs 1,000 dollars.", "She paid #### 1,000", 1.0),
    ("It costs 1000 dollars.", "1,000", 1.0),
    ("It costs 100 dollars.", "1,000", 0.0),
    ("\\boxed{72}", 72, 1.0),
    ("\\boxed{0.25}", 0.25, 1.0),
    ("I do not know.", "72", 0.0),  # no answer: the model's fault
]


def done(text: str, label: object, index: int = 0) -> Sample:
    """A finished sample whose response text is `text`."""
    return Sample(
        index=index,
        group_index=0,
        prompt="a math question",
        label=label,
        tokens=(1, 2),
        loss_mask=(0, 1),
        response_length=1,
        status=Status.COMPLETED,
        metadata={"response_text": text},
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_verdicts_on_numbers_gsm8k_latex_fractions_and_commas() -> None:
    samples = [done(text, label, i) for i, (text, label, _) in enumerate(VERDICTS)]
    scored = await score_group(samples, math_reward, timeout_s=60.0)
    wrong = [
        (text, label, expected, s.reward, s.metadata.get("error"))
        for (text, label, expected), s in zip(VERDICTS, scored, strict=True)
        if s.status is not Status.COMPLETED or s.reward != expected
    ]
    assert not wrong, wrong
    assert 1 <= len(math_pool().pids()) <= 2, math_pool().pids()  # bounded: 2 by default


def test_the_gold_math_verify_is_given() -> None:
    assert gold_answer(GSM8K) == "\\boxed{72}"
    assert gold_answer("He earns #### 1,000\n") == "\\boxed{1000}"
    assert gold_answer("(1, 2)") == "\\boxed{(1, 2)}"  # a tuple keeps its comma
    assert gold_answer("$x = 3$") == "$x = 3$"
    assert gold_answer(72) == "\\boxed{72}"
    assert gold_answer(1e-07) == "\\boxed{0.0000001}"
    with pytest.raises(ValueError, match="no gold answer"):
        gold_answer("no answer follows ####  ")
    with pytest.raises(TypeError, match="expected str, int or float"):
        gold_answer(True)


async def test_a_gold_math_verify_cannot_parse_fails_the_sample_naming_the_label() -> None:
    out = await score_sample(done("The answer is 2.", "\\frac{1}{"), math_reward, timeout_s=60.0)
    assert out.status is Status.FAILED, out
    assert out.metadata["failure"] == "reward/raised", out.metadata
    error = out.metadata["error"]
    assert "label '\\\\frac{1}{'" in error and "cannot parse its gold answer" in error, error
    empty = await score_sample(done("2", "#### "), math_reward, timeout_s=60.0)
    assert empty.status is Status.FAILED and "label '#### '" in empty.metadata["error"], empty


def test_errors_inside_math_verify_are_errors_never_a_zero() -> None:
    def verify_raises(*args: object, **kwargs: object) -> bool:
        raise TypeError("cannot compare")

    reply = grade(parse, verify_raises, "The answer is 2.", "\\boxed{2}")
    assert reply == {"error": "TypeError: cannot compare", "stage": "verify"}, reply
    with pytest.raises(MathVerifyError, match="reading the verify: TypeError: cannot compare"):
        reward_from_reply(reply, "2", "\\boxed{2}")


async def test_a_hung_verification_times_out_its_worker_is_killed_the_next_call_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HANG_ENV, HANG)
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert await math_reward(done("7", "7")) == 1.0  # the worker started
    [pid] = math_pool().pids()
    start = trio.current_time()
    out = await score_sample(done(HANG, "7"), math_reward, timeout_s=1.0)
    took_s = trio.current_time() - start
    assert out.status is Status.FAILED and out.metadata["failure"] == "reward/timed_out", out
    assert took_s < 1.0 + 2.0, f"{took_s=}: the timeout did not cancel the pipe read"
    assert not alive(pid), f"the hung worker {pid} still runs"
    assert math_pool().pids() == []
    after = await score_sample(done("The answer is 7", "7"), math_reward, timeout_s=60.0)
    assert after.status is Status.COMPLETED and after.reward == 1.0, after
    assert math_pool().pids() != [pid]


async def test_a_worker_killed_mid_request_fails_that_sample_the_next_call_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HANG_ENV, HANG)
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert await math_reward(done("7", "7")) == 1.0
    pool = math_pool()
    [pid] = pool.pids()
    out: list[Sample] = []

    async def score() -> None:
        out.append(await score_sample(done(HANG, "7"), math_reward, timeout_s=60.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(score)
        with trio.fail_after(10):
            while pool.limiter.borrowed_tokens == 0:
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # the request reaches the worker (killed before: the same error)
        os.kill(pid, signal.SIGKILL)
    [failed] = out
    assert failed.status is Status.FAILED and failed.metadata["failure"] == "reward/raised"
    error = failed.metadata["error"]
    assert f"worker pid {pid} died before it answered (killed by SIGKILL)" in error, error
    assert not alive(pid) and pool.pids() == []
    assert await math_reward(done("The answer is 7", "7")) == 1.0


def test_workers_end_with_their_trio_run() -> None:
    pids: list[int] = []

    async def run() -> None:
        assert await math_reward(done("1/2", "0.5")) == 1.0
        pids.extend(math_pool().pids())

    trio.run(run)
    assert pids and not any(alive(pid) for pid in pids), pids


def test_the_short_name_and_unknown_names() -> None:
    assert load_reward_fn("math") is math_reward
    assert load_reward_fn("rollouts.rewards.math_answer:math_reward") is math_reward
    with pytest.raises(PluginError) as unknown:
        load_reward_fn("maths")
    for part in ("rollout.reward_fn = 'maths'", "['math']", "dotted path"):
        assert part in str(unknown.value), unknown.value
    with pytest.raises(PluginError, match="the driver asks the \\[judge\\]"):
        load_reward_fn("judge")
    with pytest.raises(MissingExtra, match=r"pip install 'rollouts\[math\]'"):
        require_module("no_such_module_rollouts", "math")
