"""`math_reward`: a math answer graded by HuggingFace's math-verify (`rollout.reward_fn = "math"`,
or `"rollouts.rewards.math_answer:math_reward"`; `pip install 'rollouts[math]'`).

The response is `sample.metadata["response_text"]` (the driver sets it); the gold is
`sample.label`: after the last `####` when it holds one (GSM8K's "... #### 72"), thousands commas
dropped ("1,000"), and given to math-verify's `parse` as `\\boxed{...}` unless it carries its own
LaTeX delimiters (`\\boxed`, `$`), so `\\frac{1}{2}`, `\\sqrt{2}` or `2x+3` parse whole. 1.0 when
math-verify finds them equal, 0.0 when not or when the response holds no answer (the model's
fault). A gold math-verify cannot parse (a data error) or an error inside math-verify raises:
the sample FAILED, never a 0.

math-verify runs in worker processes (`rollouts/rewards/math_worker.py`), never in this one: a
sympy call can hang holding a core, and only a process can be killed. Each trio run has its own
pool (`$ROLLOUTS_MATH_WORKERS`, default 2), started on first use; when the scorer's timeout
cancels a request its worker is SIGKILLed and replaced (`rollouts/rewards/worker_pool.py`).
"""

from __future__ import annotations

import math
import os
import re
import sys
from decimal import Decimal
from typing import Any

import trio

from rollouts.rewards.named import require_module
from rollouts.rewards.verifiers import response_text
from rollouts.rewards.worker_pool import WorkerPool, run_pool
from rollouts.types import Sample

WORKERS_ENV = "ROLLOUTS_MATH_WORKERS"
DEFAULT_WORKERS = 2
WORKER_COMMAND = (sys.executable, "-m", "rollouts.rewards.math_worker")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DELIMITERS = ("\\boxed", "$", "\\(", "\\[")
_POOL: trio.lowlevel.RunVar[WorkerPool] = trio.lowlevel.RunVar("math_workers")


class MathVerifyError(RuntimeError):
    """math-verify raised while reading a response or comparing answers."""


def _label_text(label: Any) -> str:
    if isinstance(label, str):
        return label
    if isinstance(label, bool) or not isinstance(label, int | float):
        raise TypeError(f"label {label!r}: a {type(label).__name__}, expected str, int or float")
    if isinstance(label, float) and not math.isfinite(label):
        raise ValueError(f"label {label!r}: not a finite number")
    return format(Decimal(repr(label)), "f")  # 1e-07 -> 0.0000001: math-verify reads no 'e'


def gold_answer(label: Any) -> str:
    """The gold answer `label` holds, as math-verify's `parse` is given it (see module doc)."""
    text = _label_text(label)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    if not text:
        raise ValueError(f"label {label!r:.300}: no gold answer in it (nothing after '####'?)")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")  # "1,000"; a tuple "(1, 2)" keeps its comma
    if any(d in text for d in _DELIMITERS):
        return text
    return f"\\boxed{{{text}}}"


def worker_count() -> int:
    """How many math-verify workers a run may start: `$ROLLOUTS_MATH_WORKERS`, default 2."""
    raw = os.environ.get(WORKERS_ENV, str(DEFAULT_WORKERS))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"${WORKERS_ENV} = {raw!r}: must be an integer >= 1")
    return int(raw)


def math_pool() -> WorkerPool:
    """This trio run's math-verify workers (started on first use, killed when the run ends)."""
    return run_pool(_POOL, _make_pool)


def _make_pool() -> WorkerPool:
    require_module("math_verify", "math")
    return WorkerPool(command=WORKER_COMMAND, size=worker_count(), name="math-verify")


def reward_from_reply(reply: dict[str, Any], label: Any, gold: str) -> float:
    """The worker's verdict as a reward, or the error it reports raised (see module doc)."""
    error = reply.get("error")
    if error is not None:
        stage = reply.get("stage")
        if stage == "gold":
            raise ValueError(
                f"label {label!r:.300}: math-verify cannot parse its gold answer {gold!r}: "
                f"{error}; fix the data (a number, LaTeX, or a solution ending '#### answer')"
            )
        raise MathVerifyError(f"math-verify raised reading the {stage}: {error}")
    reward = reply.get("reward")
    assert reward in (0.0, 1.0), f"the math-verify worker replied {reply!r}"
    return float(reward)


async def math_reward(sample: Sample) -> float:
    """1.0 when math-verify finds the response's answer equal to `sample.label`'s, else 0.0;
    raises (the sample FAILED) on a gold it cannot parse or an error of its own."""
    if sample.label is None:
        raise ValueError(f"sample {sample.index}: no label (gold answer) to verify against")
    gold = gold_answer(sample.label)
    reply = await math_pool().ask({"response": response_text(sample), "gold": gold})
    return reward_from_reply(reply, sample.label, gold)
