#!/usr/bin/env bash
# The main job on a CPU laptop: build a tiny model, teach it the demo task with SFT, then RL with
# a verifier reward, printing held-out accuracy after each. Extra args go to train.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ ! -f integration_training/train.py ]; then
  echo "[demo] integration_training/train.py does not exist yet: the training loop is not built." >&2
  exit 1
fi
python integration_training/train.py --mode sft+rl --config configs/demo-cpu.toml "$@"
