"""OpenMP threads that wait sleep rather than spin (`OMP_WAIT_POLICY=PASSIVE`), unless the user
set the policy: set by the entry points before torch loads (libgomp reads it once).

Colocated sync mode gives the trainer and the engines every core in turn; with libgomp's default
(spin, then sleep) a team whose barrier waits for a thread the OS gave to another process spins
instead of yielding. Measured on the 2-core box (SmolLM2, colocated, 4 RL steps): 190 s and 328 s
with spinning waits while other processes ran, against 54-84 s passive; quiet, the tiny model's
colocated sync step took 1.24 s at the default against 1.50 s passive (the price of a sleeping
thread's wake-up on tiny ops), and the split plan 1.70-1.92 s either way.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"


def passive_waits(env: dict[str, str] | None = None) -> None:
    """`OMP_WAIT_POLICY=PASSIVE` in `env` (default: this process's) unless it is set already."""
    (os.environ if env is None else env).setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
