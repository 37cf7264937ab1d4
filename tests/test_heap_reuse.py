"""`rollouts.heap.keep_freed_memory`: a large block freed and asked for again reuses its pages
(glibc, Linux), where glibc's defaults map fresh ones; `ROLLOUTS_MALLOC=system` keeps them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from rollouts.heap import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else False
block = 256 * 2**20
first = bytearray(block)  # zero-filled: every page touched
del first
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = bytearray(block)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(took, faults)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def probe(mode: str, **env: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_block_is_reused_not_mapped_again() -> None:
    pages = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    took, faults = probe("keep")
    assert took
    assert faults < pages // 20, f"{faults} page faults for a reused block of {pages} pages"
    took, faults = probe("default")  # glibc's defaults: a fresh mapping, every page faulted
    assert not took
    assert faults > pages // 2, f"{faults=}: the defaults no longer map large blocks afresh"


def test_rollouts_malloc_system_leaves_the_defaults() -> None:
    took, faults = probe("keep", ROLLOUTS_MALLOC="system")
    assert not took
    assert faults > 256 * 2**20 // os.sysconf("SC_PAGE_SIZE") // 2
