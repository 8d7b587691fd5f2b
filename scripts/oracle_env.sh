#!/usr/bin/env bash
# Create (once) the MindSpore 2.10 oracle virtual environment used by the oracle tests and benchmarks.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/oracle-venv, override with
# RESHARD_ORACLE_VENV) so that CI and fresh clones reuse it instead of re-downloading 2.8 GB.
# numpy<2 is required: the 2.10 wheel is built against numpy 1.x and its bf16 support breaks on numpy 2.
# Prints the path of the venv's python on its last line.
set -euo pipefail
venv="${RESHARD_ORACLE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/oracle-venv}"
py="$venv/bin/python"
marker="$venv/.reshard-oracle-ok"
if [[ ! -f "$marker" ]]; then
  mkdir -p "$(dirname "$venv")"
  lock="$venv.lock"
  exec 9>"$lock"
  flock 9
  if [[ ! -f "$marker" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check "mindspore==2.10.0" "numpy<2" "safetensors" "psutil" >&2
    "$py" -c "import mindspore, numpy; assert numpy.__version__.startswith('1.')" >&2
    touch "$marker"
  fi
fi
echo "$py"
