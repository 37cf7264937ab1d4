#!/usr/bin/env bash
# Optional protocol job (not in CI): the engine clients against SGLang's and vLLM's own HTTP apps.
#
# Builds .venv-protocols (its own venv), installs the sglang and vllm wheels WITHOUT their
# dependencies (no CUDA kernels, no GPU needed) plus what their HTTP layers import, starts each
# server's real app on 127.0.0.1 with only the model behind it stubbed, and drives SGLangEngine /
# VLLMEngine through a whole sync cycle (scripts/protocols/drive.py). Exit 0 = every body was
# accepted by the real request models and every field the clients parse was there.
#
#   bash scripts/test_protocols.sh                 # both, the versions the extras install today
#   SGLANG_VERSION=0.5.8 bash scripts/test_protocols.sh sglang
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
VENV="${PROTOCOLS_VENV:-$ROOT/.venv-protocols}"
WHICH="${*:-sglang vllm}"
PY="$VENV/bin/python"
pipq() { "$PY" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }

if [ ! -x "$PY" ]; then
  echo "[protocols] creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# the torch the wheels pin (SGLang 0.5.23: 2.14.1), default build: the CPU-only torch lacks
# torchvision's C ops, which SGLang's imports load; no kernel runs here
TORCH="${PROTOCOLS_TORCH:-2.14.1}"
TORCHVISION="${PROTOCOLS_TORCHVISION:-0.29.1}"
if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null
then
  echo "[protocols] installing torch==$TORCH torchvision==$TORCHVISION"
  pipq "torch==$TORCH" "torchvision==$TORCHVISION"
fi
printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$VENV/constraints.txt"
# what the servers' HTTP layers import (read from their import errors), and the clients' own needs
pipq -c "$VENV/constraints.txt" numpy fastapi uvicorn pydantic orjson msgspec pyzmq httpx trio \
  psutil requests aiohttp uvloop setproctitle pybase64 pillow ipython dill sentencepiece einops \
  jsonschema partial-json-parser python-multipart openai gguf compressed-tensors xgrammar \
  soundfile apache-tvm-ffi triton
pipq --no-deps -e .

model="$VENV/tiny-model"
[ -f "$model/config.json" ] || "$PY" -m rollouts.cli make-tiny-model "$model" >/dev/null 2>&1

status=0
for kind in $WHICH; do
  if [ "$kind" = sglang ]; then
    pipq --no-deps "sglang==$SGLANG_VERSION"
    pipq -c "$VENV/constraints.txt" "transformers==$("$PY" - <<'EOF'
import importlib.metadata as m
req = [r for r in m.requires("sglang") if r.startswith("transformers")]
print(req[0].split("==")[1] if req and "==" in req[0] else "5.19.0")
EOF
)"
  else
    pipq --no-deps "vllm==$VLLM_VERSION"
    pipq -c "$VENV/constraints.txt" "transformers>=5.16.1,<5.21" cbor2 openai-harmony \
      prometheus-client cachetools cloudpickle py-cpuinfo llguidance watchfiles
  fi
  echo "[protocols] $kind: its own app, the project's client"
  if ! PYTHONPATH="$ROOT:$ROOT/scripts" VLLM_TARGET_DEVICE=cpu "$PY" -W ignore \
    scripts/protocols/drive.py "$kind" "$model"; then
    echo "[protocols] FAIL $kind" >&2
    status=1
  fi
done
exit "$status"
