#!/usr/bin/env bash
# Run the whole test suite in the project's .venv (created on first use). Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Tests start engine servers and torchrun ranks beside the test process on a few cores: one
# torch thread each avoids OpenMP spin-waits (tiny models; measured 30x slower oversubscribed).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
