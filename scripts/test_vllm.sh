#!/usr/bin/env bash
# The real-vLLM test job (CI runs it after scripts/test.sh): builds .venv-vllm once
# (scripts/vllm_env.sh), converts the packaged SmolLM2-135M once, then runs tests/real_vllm,
# which starts real vLLM servers on 127.0.0.1 (once per run) and drives the project through
# them. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/vllm_env.sh
rollouts models fetch smollm2-135m-instruct >/dev/null
export ROLLOUTS_VLLM_PYTHON="${VLLM_VENV:-$ROOT/.venv-vllm}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest tests/real_vllm "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test-vllm] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
