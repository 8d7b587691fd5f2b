#!/usr/bin/env bash
# Create (once) the PyTorch test virtual environment used by the DCP / torch_dist oracle tests
# (tests/torch_oracle.py): torch 2.13.0 (CPU), megatron-core, psutil and numpy, pinned in
# scripts/torch-requirements.txt.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/torch-venv, override with
# RESHARD_TORCH_VENV) so that CI and fresh clones reuse it. torch is pinned to exactly 2.13.0: pip takes
# the CPU wheel of that release from the machine's wheel folder; any other spec would download a
# multi-GB CUDA build. scripts/venv_lib.sh makes it (once, under a lock, with a marker file).
# Prints the path of the venv's python on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=venv_lib.sh
source "$here/venv_lib.sh"
venv="${RESHARD_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/torch-venv}"
ensure_venv "$venv" "$venv/.reshard-torch-2.13.0-megatron-0.16.1-ok" "$here/torch-requirements.txt" \
  "import torch, megatron.core, psutil, numpy; assert torch.__version__.startswith('2.13.0')"
echo "$venv/bin/python"
