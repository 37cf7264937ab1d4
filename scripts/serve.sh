#!/usr/bin/env bash
# Run the built-in engine server (`rollouts serve`) on a model directory; default: a tiny model
# built on first use in runs/tiny-model.
#   scripts/serve.sh [MODEL_DIR] [more `rollouts serve` options: --port 30000 --api-key K ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
MODEL="${1:-runs/tiny-model}"
shift || true
if [ ! -f "$MODEL/config.json" ]; then
  rollouts make-tiny-model "$MODEL"
fi
exec rollouts serve --model "$MODEL" "$@"
