"""The math-verify worker: `python -m rollouts.rewards.math_worker PARENT_PID`, one of the pool
`rollouts/rewards/math_answer.py` starts (`rollouts/rewards/worker_pool.py`).

It reads one JSON request a line on stdin, `{"response": ..., "gold": ...}` (the gold as
math-verify's `parse` reads it), and writes one JSON reply a line on stdout: `{"reward": 1.0}` or
`0.0` (wrong, or no answer in the response), or `{"error": ..., "stage": "gold" | "response" |
"verify"}`. Its first line is `{"ready": true}` once math-verify is imported, or `{"error": ...}`.

math-verify's own timeouts (`signal.alarm`) are off: the parent bounds each request and SIGKILLs
a worker that overruns. The worker exits at EOF on stdin, and on Linux when the thread that
started it exits (`prctl(PR_SET_PDEATHSIG)`). Stray prints go to stderr: stdout carries replies
only. `$ROLLOUTS_MATH_TEST_HANG`, for tests only: a response equal to it makes the worker sleep
(a hung verification).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

HANG_ENV = "ROLLOUTS_MATH_TEST_HANG"  # fault injection for tests: the response text that hangs
HANG_S = 3600.0
INSTALL_HINT = "math-verify is not installed: pip install 'rollouts[math]'"
MAX_ERROR_CHARS = 500
PR_SET_PDEATHSIG = 1
QUIET_LOGGERS = ("math_verify", "latex2sympy2_extended")  # "timeout disabled" warnings


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the parent's spawning thread exits (Linux); exit now if the parent
    is already gone (it died before the request was made)."""
    if sys.platform.startswith("linux"):
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os._exit(1)


def reply_channel() -> IO[str]:
    """Our stdout for replies; fd 1 now points at stderr, so a print in a library cannot break
    the protocol."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return out


def send(out: IO[str], message: dict[str, Any]) -> None:
    """Write one JSON line and flush it."""
    out.write(json.dumps(message) + "\n")
    out.flush()


def _error(stage: str, e: Exception) -> dict[str, Any]:
    text = f"{type(e).__name__}: {e}"
    return {"error": text[:MAX_ERROR_CHARS], "stage": stage}


def grade(parse: Callable[..., Any], verify: Callable[..., Any], response: str, gold: str) -> dict:
    """One reply: math-verify's verdict on `response` against `gold`. A gold that does not parse
    (an error or no answer) is an error, a response with no answer is a 0.0; math-verify's
    errors are raised to us (`raise_on_error=True`), never folded into False."""
    try:
        golds = parse(gold, fallback_mode="no_fallback", parsing_timeout=None, raise_on_error=True)
    except Exception as e:
        return _error("gold", e)
    if not golds:
        return {"error": f"no answer found in {gold[:MAX_ERROR_CHARS]!r}", "stage": "gold"}
    try:
        answers = parse(response, parsing_timeout=None, raise_on_error=True)
    except Exception as e:
        return _error("response", e)
    if not answers:
        return {"reward": 0.0}  # no extractable answer: the model's fault
    try:
        same = verify(golds, answers, timeout_seconds=None, raise_on_error=True)
    except Exception as e:
        return _error("verify", e)
    return {"reward": 1.0 if same else 0.0}


def serve(out: IO[str]) -> int:
    """Import math-verify, say ready, then answer requests until EOF on stdin."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        send(out, {"error": f"{INSTALL_HINT} ({e})"})
        return 1
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    send(out, {"ready": True})
    hang_on = os.environ.get(HANG_ENV)
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if hang_on is not None and request["response"] == hang_on:
            time.sleep(HANG_S)
        send(out, grade(parse, verify, request["response"], request["gold"]))
    return 0


def main(argv: list[str]) -> int:
    """`math_worker PARENT_PID`."""
    assert len(argv) == 2, f"usage: python -m rollouts.rewards.math_worker PARENT_PID, got {argv}"
    die_with_parent(int(argv[1]))
    return serve(reply_channel())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
