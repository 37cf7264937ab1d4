"""Answer extraction, exact / numeric verifiers, and time-bounded scoring (FAILED, never 0)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
import trio

from rollouts.rewards.scoring import as_reward, count_failed, score_group, score_sample
from rollouts.rewards.verifiers import (
    exact_match_reward,
    extract_final_answer,
    make_exact_match_reward,
    normalize_answer,
    numeric_reward,
    response_text,
)
from rollouts.types import Sample, Status


def done(text: str | None, label="85", status=Status.COMPLETED, tokens=(1, 2, 3)) -> Sample:
    meta = {} if text is None else {"response_text": text}
    return Sample(
        index=0,
        group_index=0,
        prompt="47+38",
        label=label,
        tokens=tokens,
        loss_mask=(0,) + (1,) * (len(tokens) - 1),
        response_length=len(tokens) - 1,
        status=status,
        metadata=meta,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7+8=15 4+3+1=8 Answer: 85", "85"),  # the demo format
        ("work\n#### 1,234\n", "1,234"),
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("The answer is 42.", "42"),
        ("Answer: yes.", "yes"),
        ("first 3 then 17 and -4.5", "-4.5"),  # last-number fallback
        ("no digits here", None),
        ("Answer: 1 ... Answer: 2", "2"),  # the last marker wins
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_normalize_answer():
    assert normalize_answer(" $1,234$. ") == "1234"
    assert normalize_answer("\\text{Yes}") == "yes"


def test_exact_match_and_numeric():
    assert exact_match_reward(done("4+3+1=8 Answer: 85")) == 1.0
    assert exact_match_reward(done("Answer: 86")) == 0.0
    assert exact_match_reward(done("I give up")) == 0.0  # no answer: wrong, not an error
    close = numeric_reward(tol=0.01)
    assert close(done("Answer: 85.004")) == 1.0
    assert close(done("Answer: 85.5")) == 0.0
    assert numeric_reward()(done("#### 3/4", label="0.75")) == 1.0
    with pytest.raises(ValueError, match="no label"):
        exact_match_reward(done("Answer: 85", label=None))


def test_response_text_decodes_tokens_when_no_text_stored():
    decode = lambda ids: "Answer: " + "".join(str(i) for i in ids)  # noqa: E731
    assert response_text(done(None, tokens=(0, 8, 5)), decode) == "Answer: 85"
    assert make_exact_match_reward(decode)(done(None, tokens=(0, 8, 5))) == 1.0
    with pytest.raises(ValueError, match="tokenizer_decoder"):
        response_text(done(None))


def test_as_reward():
    assert as_reward(1) == 1.0
    assert as_reward([1, 0.5]) == (1.0, 0.5)
    assert as_reward(True) == 1.0  # `return answer == label`
    for bad in (None, "1", "1.0", float("nan"), float("inf"), -float("inf"), [], [1.0, "x"]):
        with pytest.raises((TypeError, ValueError)):
            as_reward(bad)


REAL_SCALARS = [
    (np.float32(0.5), 0.5),
    (np.float16(0.25), 0.25),
    (np.int64(3), 3.0),
    (np.uint8(2), 2.0),
    (np.bool_(True), 1.0),
    (np.array(0.75), 0.75),
    (np.array(1, dtype=np.int32), 1.0),
    (np.array(False), 0.0),
    (torch.tensor(0.5), 0.5),
    (torch.tensor(2), 2.0),
    (torch.tensor(True), 1.0),
    (torch.tensor(1.5, dtype=torch.bfloat16), 1.5),
]


@pytest.mark.parametrize(("value", "expected"), REAL_SCALARS, ids=lambda v: repr(v)[:30])
async def test_every_real_scalar_is_a_reward(value, expected):
    assert as_reward(value) == expected and type(as_reward(value)) is float
    assert as_reward((value, 1)) == (expected, 1.0)
    scored = await score_sample(done("Answer: 85"), lambda s: value, timeout_s=5)
    assert scored.status is Status.COMPLETED and scored.reward == expected, scored.metadata


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.array([1.0, 2.0]), "numpy.ndarray of shape (2,)"),
        (torch.tensor([0.5]), "torch.Tensor of shape (1,)"),
        (np.complex64(1), "numpy.complex64"),
        (np.str_("1.0"), "numpy.str_"),
        (np.array("1"), "numpy.ndarray"),
        (torch.tensor(1j), "torch.Tensor"),
        ("1.0", "str"),
        ({"score": 1.0}, "dict"),
        (np.float32("nan"), "non-finite"),
        (torch.tensor(float("inf")), "non-finite"),
    ],
    ids=lambda v: repr(v)[:30],
)
async def test_anything_else_is_refused_naming_its_type(value, named):
    with pytest.raises((TypeError, ValueError), match=re.escape(named)):
        as_reward(value)
    scored = await score_sample(done("Answer: 85"), lambda s: value, timeout_s=5)
    assert scored.status is Status.FAILED and named in scored.metadata["error"]


async def test_score_sample_sets_reward_without_mutation():
    sample = done("Answer: 85")
    out = await score_sample(sample, exact_match_reward, timeout_s=5)
    assert out.reward == 1.0
    assert sample.reward is None  # the input record is untouched
    aborted = done("Answer: 85", status=Status.ABORTED)
    assert await score_sample(aborted, exact_match_reward, timeout_s=5) is aborted


async def test_raising_or_bad_reward_is_failed_not_zero():
    def boom(sample):
        raise RuntimeError("verifier crashed")

    out = await score_sample(done("x"), boom, timeout_s=5)
    assert out.status is Status.FAILED
    assert out.reward is None
    assert "RuntimeError: verifier crashed" in out.metadata["error"]
    nan = await score_sample(done("x"), lambda s: float("nan"), timeout_s=5)
    assert nan.status is Status.FAILED
    assert "non-finite" in nan.metadata["error"]


async def test_timeouts_sync_and_async(autojump_clock):
    release = threading.Event()

    def hangs(sample):
        release.wait(60)  # a stuck verifier thread; abandoned by the time bound
        return 1.0

    async def hangs_async(sample):
        await trio.sleep_forever()

    try:
        out = await score_sample(done("x"), hangs, timeout_s=2)
        assert out.status is Status.FAILED
        assert "timed out after 2" in out.metadata["error"]
        out = await score_sample(done("x"), hangs_async, timeout_s=2)
        assert out.status is Status.FAILED
    finally:
        release.set()


async def test_score_group_in_order_and_counted():
    async def by_text(sample):
        if sample.metadata["response_text"] == "bad":
            raise ValueError("unparseable")
        return exact_match_reward(sample)

    group = [done("Answer: 85"), done("bad"), done("Answer: 1")]
    out = await score_group(group, by_text, timeout_s=5, limiter=trio.CapacityLimiter(2))
    assert [s.reward for s in out] == [1.0, None, 0.0]
    assert count_failed(out) == 1
