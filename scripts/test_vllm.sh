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
# Two pytest processes side by side, each starting only the servers its tests use: the tests on
# the SmolLM2 server (-m smollm2, most of the job's time) and the rest (the three tiny servers).
# The job used about 1.5 of 2 cores in one process. ROLLOUTS_VLLM_STREAMS=1: one process.
if [ "${ROLLOUTS_VLLM_STREAMS:-2}" = 1 ]; then
  set +e
  python -m pytest tests/real_vllm "$@"
  rc=$?
  set -e
  [ "$rc" -ne 5 ] || { echo "[test-vllm] pytest collected no tests: that is a failure" >&2; exit 1; }
  exit "$rc"
fi
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
declare -A pids
# The SmolLM2 stream is the longer one: the tiny one (its servers too) runs at a lower priority,
# so that SmolLM2's server starts and its timed tests (pause, abort) run first on a busy box.
for stream in smollm2 tiny; do
  marker=$([ "$stream" = smollm2 ] && echo smollm2 || echo "not smollm2")
  niceness=$([ "$stream" = smollm2 ] && echo 0 || echo 10)
  nice -n "$niceness" python -m pytest tests/real_vllm -m "$marker" "$@" > "$logs/$stream.log" 2>&1 &
  pids[$stream]=$!
done
rc=0
ran=0
for stream in tiny smollm2; do  # the tiny one ends first: its output shows while SmolLM2 runs
  set +e
  wait "${pids[$stream]}"
  code=$?
  set -e
  echo "[test-vllm] ---- the $stream servers' tests (pytest exit $code) ----"
  cat "$logs/$stream.log"
  case "$code" in
    0) ran=1 ;;
    5) ;;  # this stream's tests were all deselected (-k, -m or a path in the arguments)
    *) rc=$code ;;
  esac
done
if [ "$rc" -eq 0 ] && [ "$ran" -eq 0 ]; then
  echo "[test-vllm] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
