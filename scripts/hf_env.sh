#!/usr/bin/env bash
# Create (once) the Hugging Face test virtual environment used by the preset tests (tests/hf.py):
# torch 2.13.0 (CPU), transformers, safetensors and numpy, pinned in scripts/hf-requirements.txt.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/hf-venv, override with
# RESHARD_HF_VENV) so that CI and fresh clones reuse it. torch is pinned to exactly 2.13.0: pip takes
# the CPU wheel of that release from the machine's wheel folder; any other spec would download a
# multi-GB CUDA build. scripts/venv_lib.sh makes it (once, under a lock, with a marker file).
# Prints the path of the venv's python on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=venv_lib.sh
source "$here/venv_lib.sh"
venv="${RESHARD_HF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/hf-venv}"
ensure_venv "$venv" "$venv/.reshard-hf-transformers-5.23.0-ok" "$here/hf-requirements.txt" \
  "import torch, transformers, safetensors, numpy; assert torch.__version__.startswith('2.13.0')"
echo "$venv/bin/python"
