#!/usr/bin/env bash
# Run the whole test suite in the project's .venv (created on first use). Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Tests start engine servers and torchrun ranks beside the test process on a few cores: one
# torch thread each avoids OpenMP spin-waits (tiny models; measured 30x slower oversubscribed).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Test files run in parallel on up to ROLLOUTS_TEST_WORKERS processes (default: the cores, at most
# 4; 1 = one process). Most tests wait on servers and child processes, so on the 2-core CI box two
# workers took the suite from 17m00s to 10m20s. A file's tests stay in one worker (its module
# fixtures are built once); the files with `slow` tests go first (tests/conftest.py), in that
# order (--no-loadscope-reorder). An explicit -n or -p no:xdist in the arguments wins.
workers="${ROLLOUTS_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
parallel=()
if [ "$workers" -gt 1 ] && [[ " $* " != *" -n "* && " $* " != *" -n="* && " $* " != *"no:xdist"* ]]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
set +e
python -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
