#!/usr/bin/env bash
# Create (once) the oracle virtual environment used by the oracle tests and benchmarks:
# MindSpore 2.10.0 and MindFormers 2.1.0, pinned in scripts/oracle-requirements.txt.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/oracle-venv, override with
# RESHARD_ORACLE_VENV) so that CI and fresh clones reuse it instead of re-downloading 2.8 GB.
# numpy<2 is required: the 2.10 wheel is built against numpy 1.x and its bf16 support breaks on numpy 2.
# MindFormers goes in with --no-deps: it declares mindspore~=2.11 and hyper-parallel, which the registry
# does not have; the pinned set is what its imports need. A venv made before MindFormers was added is
# completed in place (the second marker). Prints the path of the venv's python on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${RESHARD_ORACLE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/oracle-venv}"
py="$venv/bin/python"
marker="$venv/.reshard-oracle-ok"
mf_marker="$venv/.reshard-oracle-mindformers-2.1.0-ok"
if [[ ! -f "$marker" || ! -f "$mf_marker" ]]; then
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
  if [[ ! -f "$mf_marker" ]]; then
    "$py" -m pip install -q --disable-pip-version-check --no-deps -r "$here/oracle-requirements.txt" >&2
    # mindformers' import makes output/log in the working directory: check it from a scratch folder
    (cd "$(mktemp -d)" && "$py" -c "import mindformers, mindspore, numpy; assert numpy.__version__.startswith('1.')") >&2
    touch "$mf_marker"
  fi
fi
echo "$py"
