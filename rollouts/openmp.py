"""OpenMP threads that wait spin briefly, then sleep: the entry points set
`OMP_WAIT_POLICY=PASSIVE` with `GOMP_SPINCOUNT=30000` (about 0.3 ms of spinning; libgomp reads
both once, before torch loads) unless the user set the wait policy.

Colocated sync mode gives the trainer and the engines every core in turn. libgomp's default
(spin about 3 ms, then sleep) makes a team whose barrier waits for a thread the OS gave to
another process spin instead of yielding; fully passive waits make every small op pay a sleeping
thread's wake-up. Measured on the 2-core box, one run each (`scripts/bench_trl.py --case A
--systems sync`, the tiny model's colocated sync step; SmolLM2: 4 RL steps of smollm2-cpu.toml):

    waits                     tiny, quiet   tiny, 2 busy processes   SmolLM2 quiet   SmolLM2 busy
    passive (spin 0)          1.456 s       3.258 s                  66.5 s          120.6 s
    spin 3,000                1.132 s       3.091 s
    spin 30,000 (this)        1.068 s       2.838 s                  62.9 s          125.8 s
    spin 300,000 (default)    1.056 s       4.737 s

Async mode (split cores) is the same either way: 0.922 s passive, 0.933 s at 30,000.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"
SPIN_COUNT = "30000"


def short_spin_waits(env: dict[str, str] | None = None) -> None:
    """Short spins, then sleep, in `env` (default: this process's): `OMP_WAIT_POLICY=PASSIVE`
    and `GOMP_SPINCOUNT=30000`, unless the wait policy is set already (a spin count the user set
    is kept)."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env:
        return
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
