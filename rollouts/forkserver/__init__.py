"""A forkserver for Python programs of this project: one process imports what they import (torch,
transformers, the engine, the trainer, the driver) and forks each program from there, so a start
costs the program's own work, not the 3-5 CPU-seconds of imports (`scripts/bench_engine_start.py`).

Opt-in: `ROLLOUTS_FORKSERVER=<socket path>` in the environment (the test suite sets it,
`tests/conftest.py`). The engine launcher (`engine/launch.py`) and the trainer process
(`trainer/process.py`) ask the server first (`client.fork`) and start a fresh process when there is
none, or when it refuses. `client.py` is the asking side, `server.py` the server.
"""

from rollouts.forkserver.client import ENV_VAR, ForkedProcess, Refused, fork, popen, start_server

__all__ = ["ENV_VAR", "ForkedProcess", "Refused", "fork", "popen", "start_server"]
