"""A test's run of a program of this project (`train.py`, `python -m rollouts...`), forked by the
suite's forkserver where there is one (tests/conftest.py; `rollouts/forkserver/`): `run` is
`subprocess.run(argv, capture_output=True, text=True, ...)` without the seconds of imports a fresh
interpreter spends; `popen` is `subprocess.Popen`'s (`rollouts.forkserver.popen`). Where no
server forks it (none, or the environment differs in a variable read at import time), a fresh
process runs it, as before."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollouts.forkserver import fork, popen
from rollouts.forkserver.client import PROXY

__all__ = ["FORKED_RANK", "popen", "run"]

# before a torchrun command's `-m MODULE`: each rank forked behind `rollouts.forkserver.proxy`
# (torchrun holds the proxy as the rank's process; without a server it becomes the rank, fresh)
FORKED_RANK = PROXY


def run(
    argv: Sequence[str | Path],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True, cwd=, env=, timeout=)`."""
    args = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        cwd_s = None if cwd is None else str(Path(cwd).resolve())
        proc = fork(args, env, {0: 0, 1: out_w, 2: err_w}, cwd=cwd_s)
    finally:
        os.close(out_w)
        os.close(err_w)
    if proc is None:
        os.close(out_r)
        os.close(err_r)
        return subprocess.run(
            args, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
        )
    texts: dict[int, str] = {}
    readers = [threading.Thread(target=_read, args=(fd, texts)) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for reader in readers:
            reader.join()
        raise subprocess.TimeoutExpired(args, timeout or 0.0, texts[out_r], texts[err_r]) from None
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(args, code, texts[out_r], texts[err_r])


def _read(fd: int, into: dict[int, str]) -> None:
    """All of a pipe, as text (`subprocess.run(text=True)`'s decoding)."""
    with open(fd, encoding=None, errors="strict", newline=None) as pipe:
        into[fd] = pipe.read()
