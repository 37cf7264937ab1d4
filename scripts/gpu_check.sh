#!/usr/bin/env bash
# The GPU checks, in one go on a one-GPU machine (never in CI). Each part has its own time limit
# and log; a failed part does not stop the next one.
#   colocated: configs/gpu-demo-colocated.toml shortened (SFT, then RL with the built-in engine
#     asleep while the trainer trains), its metrics and the engine's log (GPU memory asleep and
#     awake)
#   engine: scripts/bench_engine.py, the built-in engine against in-process `generate` (bf16)
#   awake: the same RL from colocated's SFT model with the engine awake throughout
#   mfu: scripts/bench_train.py, the ~0.4B model's training step and its MFU
#   compile: scripts/bench_train.py --only compile, the same step with model.compile against
#     eager (MFU of each, the ratio, the top kernels of one step of each)
#   profile: scripts/profile_decode.py, the engine's decode step against generate's, profiled
#   compile32: compile at twice the micro-batch (32 x 1024 tokens): MFU once the GPU, not the
#     host's launches, sets the pace
#   tests: the CUDA tests (captured decode steps; the engine under autocast in CUDA graphs)
#   autocast: a short RL run (no SFT) with the engine under bf16 autocast, then with bf16
#     weights: step phases and the content check's gap of each
#
#   bash scripts/gpu_check.sh [OUT_DIR] [PARTS]   # default: "compile profile engine colocated"
# With GPU_CHECK_SMALL=1 it runs the same steps on CPU with a small model (checks the script).
# Wheels of what the machine lacks may wait in .whl/ (trio, hypercorn, starlette, ...).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-${OUT:-runs/gpu-check}}
PARTS=${2:-compile profile engine colocated}
mkdir -p "$OUT_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a crashing server prints its stacks
PY=${PYTHON:-python3}

if [ "${GPU_CHECK_SMALL:-0}" = 1 ]; then
  DEV=cpu DTYPE=float32 HIDDEN=64 LAYERS=2 HEADS=4 INTER=256 SFT=10 RL=2 SEQ=128 BATCH=2
  PROMPTS=4 NEW=16 ROWS=16
else
  DEV=cuda DTYPE=bfloat16 HIDDEN=1024 LAYERS=24 HEADS=16 INTER=4096 SFT=150 RL=8 SEQ=1024
  BATCH=16 PROMPTS=32 NEW=256 ROWS=256
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name())"
fi
SYNC_DIR=/dev/shm/gpu-check
[ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 8000000 ] 2>/dev/null \
  || SYNC_DIR=/tmp/gpu-check-sync
echo "weight copies in $SYNC_DIR"

run_part() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  grep -vE "Loading weights|it/s\]|FutureWarning|return forward_call" "$OUT_DIR/$name.log" \
    | tail -n 30
}

RUN=runs/gpu-check-colocated
MODEL_SET=(--set "model.tiny.hidden_size=$HIDDEN" --set "model.tiny.num_layers=$LAYERS"
  --set "model.tiny.num_heads=$HEADS" --set "model.tiny.intermediate_size=$INTER"
  --set "training.device=$DEV" --set "engines.builtin.device=$DEV"
  --set "engines.builtin.dtype=$DTYPE" --set "weight_sync.dir=$SYNC_DIR"
  --set "training.rl_steps=$RL" --set "training.eval_every=4" --set "checkpoint.every=0")

for part in $PARTS; do
  case $part in
  colocated)
    run_part colocated 200 $PY integration_training/train.py --mode sft+rl \
      --config configs/gpu-demo-colocated.toml "${MODEL_SET[@]}" \
      --set "run.output_dir=$RUN" --set "model.path=$RUN/base-model" \
      --set "training.sft_steps=$SFT"
    cp "$RUN/metrics.jsonl" "$OUT_DIR/colocated_metrics.jsonl" 2>/dev/null
    grep -vE "FutureWarning|return forward_call" "$RUN"/engines/*.log \
      >"$OUT_DIR/colocated_engine.log" 2>/dev/null
    grep -hE "asleep|awake" "$OUT_DIR/colocated_engine.log" 2>/dev/null | head -n 12
    if [ -f "$RUN/error.log" ]; then
      cp "$RUN/error.log" "$OUT_DIR/colocated_error.log"
      tail -n 25 "$RUN/error.log"
      tail -n 25 "$OUT_DIR/colocated_engine.log"
    fi
    SFT_MODEL=$(ls -d "$RUN"/checkpoints/sft/step_*/model 2>/dev/null | tail -1)
    [ -n "$SFT_MODEL" ] && mv "$SFT_MODEL" /tmp/gpu-check-sft-model && rm -rf "$RUN/checkpoints"
    ;;
  awake)  # after colocated: its SFT model, RL with the engine awake throughout
    run_part awake 150 $PY integration_training/train.py --mode rl \
      --config configs/gpu-demo-colocated.toml "${MODEL_SET[@]}" \
      --set "run.output_dir=$RUN-awake" --set "model.path=/tmp/gpu-check-sft-model" \
      --set model.tiny.enabled=false --set engines.sleep_level=0
    cp "$RUN-awake/metrics.jsonl" "$OUT_DIR/awake_metrics.jsonl" 2>/dev/null
    ;;
  mfu)
    run_part mfu 150 $PY scripts/bench_train.py --device "$DEV" --only train \
      --hidden "$HIDDEN" --layers "$LAYERS" --heads "$HEADS" --intermediate "$INTER" \
      --seq "$SEQ" --batch "$BATCH" --reps 3 --rounds 2
    ;;
  compile)
    run_part compile 150 $PY scripts/bench_train.py --device "$DEV" --only compile \
      --hidden "$HIDDEN" --layers "$LAYERS" --heads "$HEADS" --intermediate "$INTER" \
      --seq "$SEQ" --batch "$BATCH" --reps 3 --rounds 2 --profile
    ;;
  engine)
    run_part engine 100 $PY scripts/bench_engine.py --device "$DEV" --dtype "$DTYPE" \
      --hidden "$HIDDEN" --layers "$LAYERS" --heads "$HEADS" --intermediate "$INTER" \
      --prompts "$PROMPTS" --group 8 --equal-len "$NEW" --max-batch "$ROWS" \
      --connections 64 --clients groups --reps 1
    ;;
  compile32)
    run_part compile32 170 $PY scripts/bench_train.py --device "$DEV" --only compile \
      --hidden "$HIDDEN" --layers "$LAYERS" --heads "$HEADS" --intermediate "$INTER" \
      --seq "$SEQ" --batch $((BATCH * 2)) --reps 3 --rounds 2
    ;;
  tests)
    run_part tests 150 $PY -m pytest -q -s -p no:cacheprovider tests/engine/test_graphs.py \
      tests/engine/test_precision.py
    ;;
  autocast)
    for mode in autocast bf16; do
      if [ $mode = autocast ]; then ENG=(--set engines.builtin.dtype=float32
        --set engines.builtin.autocast=bfloat16); else ENG=(); fi
      run_part "rl_$mode" 120 $PY integration_training/train.py --mode rl \
        --config configs/gpu-demo-colocated.toml "${MODEL_SET[@]}" "${ENG[@]}" \
        --set "run.output_dir=$RUN-$mode" --set "model.path=$RUN-$mode/base-model" \
        --set training.rl_steps=4 --set training.eval_every=0
      cp "$RUN-$mode/metrics.jsonl" "$OUT_DIR/rl_${mode}_metrics.jsonl" 2>/dev/null
      $PY - "$RUN-$mode/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for key in ("perf/step_time_s", "time/generate_s", "time/train_s", "time/sync_s",
            "sync/content_gap_max", "train/logprob_mismatch"):
    values = [r[key] for r in rows if key in r]
    if values:
        print(f"  {key}: median {statistics.median(values):.4f} over {len(values)}")
PY
    done
    ;;
  profile)
    run_part profile 75 $PY scripts/profile_decode.py --device "$DEV" --dtype "$DTYPE" --rounds 1 \
      --rows "$ROWS" --hidden "$HIDDEN" --layers "$LAYERS" --heads "$HEADS" \
      --intermediate "$INTER" --steps 32
    ;;
  *) echo "unknown part $part" ;;
  esac
done
