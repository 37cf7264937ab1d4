#!/usr/bin/env bash
# TRL's GRPOTrainer for scripts/bench_trl.py, in its own venv, .venv-trl: a dev-only tool for the
# comparison, not a dependency of the project. The benchmark builds the model and the prompts with
# the project's venv and hands the TRL worker (scripts/trl_worker.py) only paths; the project is
# not installed here (the worker imports the project's reward from the source tree: it needs trio). Idempotent: a stamp file says it is complete; a second run is instant.
# torch==2.13.0 goes in first (the local CPU wheel; a bare requirement would pull CUDA builds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRL_VENV:-$ROOT/.venv-trl}"
TRL="${TRL_VERSION:-1.16.0}"
TRANSFORMERS="${TRL_TRANSFORMERS_VERSION:-5.23.0}"
stamp="$VENV/.rollouts-trl-$TRL-transformers-$TRANSFORMERS"
[ -f "$stamp" ] && exit 0
started=$(date +%s)
pipq() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[trl-env] installing torch==2.13.0 into $VENV"
  pipq torch==2.13.0
fi
echo "[trl-env] installing trl==$TRL, transformers==$TRANSFORMERS, datasets, accelerate, trio"
pipq torch==2.13.0 "trl==$TRL" "transformers==$TRANSFORMERS" datasets accelerate trio
"$VENV/bin/python" -m pip check
"$VENV/bin/python" -c "import torch, transformers, trl, trio; from trl import GRPOConfig, GRPOTrainer
assert torch.__version__.startswith('2.13.0'), torch.__version__
print(f'[trl-env] trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}')"
touch "$stamp"
echo "[trl-env] ready in $(( $(date +%s) - started )) s: $VENV"
