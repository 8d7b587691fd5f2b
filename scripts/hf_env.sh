#!/usr/bin/env bash
# Create (once) the Hugging Face test virtual environment used by the preset tests (tests/hf.py):
# torch 2.13.0 (CPU), transformers, safetensors and numpy, pinned in scripts/hf-requirements.txt.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/hf-venv, override with
# RESHARD_HF_VENV) so that CI and fresh clones reuse it. torch is pinned to exactly 2.13.0: pip takes
# the CPU wheel of that release from the machine's wheel folder; any other spec would download a
# multi-GB CUDA build. A lock serialises concurrent first uses (parallel test workers); a marker file
# says the venv is complete. Prints the path of the venv's python on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${RESHARD_HF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/hf-venv}"
py="$venv/bin/python"
marker="$venv/.reshard-hf-transformers-5.23.0-ok"
if [[ ! -f "$marker" ]]; then
  mkdir -p "$(dirname "$venv")"
  lock="$venv.lock"
  exec 9>"$lock"
  flock 9
  if [[ ! -f "$marker" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check -r "$here/hf-requirements.txt" >&2
    "$py" -c "import torch, transformers, safetensors, numpy; assert torch.__version__.startswith('2.13.0')" >&2
    touch "$marker"
  fi
fi
echo "$py"
