#!/usr/bin/env bash
# The start after `pip install`, checked outside the repository: build the wheel from a copy of the
# working tree, install it (not editable) in a fresh venv, then in an empty directory run
# `rollouts init demo` and the command it prints, the demo, to the end (about 2.5 minutes on 2
# cores, plus the installs). Each step prints its command and its time; the demo ends with its
# held-out accuracy before and after RL.
#   bash scripts/check_wheel.sh                        # the whole demo
#   bash scripts/check_wheel.sh --set training.rl_steps=2 --set training.sft_steps=20  # quick
# Extra args go to `rollouts train`. Everything lives under one `mktemp -d` in /tmp, removed at
# the end unless ROLLOUTS_KEEP_CHECK=1. PYTHON picks the interpreter of the new venv (python3);
# the wheel is built by .venv's (scripts/env.sh makes it) without build isolation: no network.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
BUILD_PY="$ROOT/.venv/bin/python"
[ -x "$BUILD_PY" ] || { echo "[check_wheel] no $BUILD_PY: run bash scripts/env.sh first" >&2; exit 1; }
WORK="$(mktemp -d /tmp/rollouts-wheel-check.XXXXXX)"
cleanup() {
  echo "[check_wheel] removing $WORK (ROLLOUTS_KEEP_CHECK=1 keeps it)"
  rm -rf "$WORK"
}
if [ "${ROLLOUTS_KEEP_CHECK:-0}" != 1 ]; then trap cleanup EXIT; fi
unset PYTHONPATH VIRTUAL_ENV  # nothing of the checkout may leak into the installed program
STARTED=$EPOCHREALTIME

since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }'; }

quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }  # pip's index noise

step() {  # step NAME CMD...: print the command, run it, print its time
  local name="$1" t0=$EPOCHREALTIME
  shift
  local shown="$*"
  echo "[check_wheel] $name: ${shown#quiet }"
  "$@"
  awk -v n="$name" -v t="$(since "$t0")" 'BEGIN { printf "[check_wheel] %s: done in %.1f s\n", n, t }'
}

mkdir -p "$WORK/src" "$WORK/whl" "$WORK/empty"
# a copy: an in-tree build would leave build/ in the checkout, and setuptools puts a stale
# build/lib (a module removed since) into the next wheel
step copy tar -C "$ROOT" --exclude=__pycache__ -cf "$WORK/src.tar" pyproject.toml README.md rollouts
tar -C "$WORK/src" -xf "$WORK/src.tar"
step wheel "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/whl" "$WORK/src"
WHEEL="$(ls "$WORK"/whl/rollouts-*.whl)"
step recipes-in-wheel bash -c "'$BUILD_PY' -m zipfile -l '$WHEEL' | grep 'rollouts/recipes/.*toml'"
step venv "$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
step torch quiet "$VPY" -m pip install -q torch==2.13.0  # first: a bare torch would pull CUDA wheels
step rollouts quiet "$VPY" -m pip install -q "$WHEEL"
export PATH="$WORK/venv/bin:$PATH"  # as `source venv/bin/activate` does
cd "$WORK/empty"
step installed-copy "$VPY" -c "import rollouts, sys; print(rollouts.__file__); \
sys.exit(not rollouts.__file__.startswith('$WORK/venv/'))"
step init bash -c "set -o pipefail; rollouts init demo | tee '$WORK/init.log'"
NEXT="$(tail -n 1 "$WORK/init.log" | sed 's/^ *//')"  # the command init printed, run as printed
[ "$NEXT" = "cd demo && rollouts train --mode sft+rl --config demo-cpu.toml" ] || {
  echo "[check_wheel] init printed another next command: $NEXT" >&2; exit 1; }
EXTRA="$( (($#)) && printf ' %q' "$@" || true)"
step train eval "$NEXT$EXTRA"
awk -v t="$(since "$STARTED")" -v w="$WORK" \
  'BEGIN { printf "[check_wheel] all steps passed in %.0f s (%s)\n", t, w }'
