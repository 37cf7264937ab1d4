#!/usr/bin/env bash
# Serve a model with the real vLLM on this CPU, ready for rollouts (engines.kind = "vllm"):
#   bash scripts/serve_vllm.sh MODEL_DIR [PORT] [more vLLM arguments...]
# Dev mode is on (the RL routes: /collective_rpc reload, /pause, /resume, /abort_requests,
# /update_weight_version, /weight_info); fp32 so the engine's logprobs match the trainer's.
# Environment: VLLM_CPU_KVCACHE_SPACE (KV cache GiB, default 2), MAX_MODEL_LEN (default: the
# model's max_position_embeddings),
# VLLM_CPU_OMP_THREADS_BIND (the cores of its worker, e.g. "1"; vLLM's default takes one core
# and reserves another). Builds .venv-vllm first when missing (scripts/vllm_env.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
[ $# -ge 1 ] || { echo "usage: $0 MODEL_DIR [PORT] [vLLM args...]" >&2; exit 2; }
model="$1"
port="${2:-8000}"
shift $(( $# >= 2 ? 2 : 1 ))
bash "$ROOT/scripts/vllm_env.sh"
export VLLM_SERVER_DEV_MODE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
len_args=()
[ -n "${MAX_MODEL_LEN:-}" ] && len_args=(--max-model-len "$MAX_MODEL_LEN")
# --no-enable-chunked-prefill: with it (vLLM's default) a seeded request whose prefill is split
# over two steps kills the CPU engine ("CPU Generator does not use offset", vLLM 0.32), and
# rollouts seeds every request; 128 concurrent RL requests split prefills within seconds
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
  --host 127.0.0.1 --port "$port" --dtype float32 --no-enable-chunked-prefill \
  "${len_args[@]}" "$@"
