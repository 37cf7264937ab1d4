# Sourced by env.sh and vllm_env.sh: `pip_install VENV_PYTHON ARGS...` installs into that venv
# with uv (resolves and unpacks in parallel, byte-compiles on every core: a fresh .venv in about
# 25 s against pip's 60, .venv-vllm in 36 s against 105, and half the CPU; the same versions),
# falling back to pip where uv cannot be installed or fails. uv does not read pip's configuration:
# its find-links, constraints and certificate bundle are handed over here. ROLLOUTS_PIP=pip forces
# pip. Both byte-compile: this box sets PYTHONDONTWRITEBYTECODE=1, so a package installed without
# its .pyc would be compiled again by every process that imports it.

_pip_quiet() { { grep -v "is ignored: it is neither" || true; }; }

# pip's setting NAME (e.g. find-links), from its environment variable or its configuration files
_pip_setting() {
  local var="PIP_$(echo "$2" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then echo "${!var}"; else "$1" -m pip config get "global.$2" 2>/dev/null || true; fi
}

pip_install() {
  local py="$1"
  shift
  local uv
  uv="$(dirname "$py")/uv"
  if [ "${ROLLOUTS_PIP:-uv}" != pip ] && { [ -x "$uv" ] || "$py" -m pip install -q uv 2>&1 | _pip_quiet; } && [ -x "$uv" ]; then
    local settings=() value
    value="$(_pip_setting "$py" find-links)" && [ -n "$value" ] && settings+=("UV_FIND_LINKS=$value")
    value="$(_pip_setting "$py" constraint)" && [ -n "$value" ] && settings+=("UV_CONSTRAINT=$value")
    value="$(_pip_setting "$py" cert)" && [ -n "$value" ] && settings+=("SSL_CERT_FILE=$value")
    if env "${settings[@]}" "$uv" pip install -q --python "$py" --compile-bytecode "$@"; then
      return 0
    fi
    echo "[pip_install] uv failed: installing with pip" >&2
  fi
  "$py" -m pip install -q "$@" 2>&1 | _pip_quiet
}
