#!/usr/bin/env bash
# Make (once) and refresh the benchmark's virtual environment: what a new user gets from a fresh
# `pip install .`, the newest release of every dependency, nothing else (bench/run.py and
# bench/startup.py run reshard in it unless --python names another interpreter).
#
# Why a venv of its own: a figure must be the one a user sees, and a base interpreter carries what
# its machine put there (this project's build VMs add a .pth file that imports certifi in every
# Python process, ~9 ms of each reshard process; MindSpore's venv and `cp` never pay it). Each call
# upgrades every dependency to its newest release (--upgrade-strategy eager) and reinstalls reshard
# from this checkout; the bench records the versions it ran with. Without a package registry the
# existing venv is used as it is, with a warning.
#
# It lives in a cache folder outside the checkout (default ~/.cache/reshard/bench-venv, override with
# RESHARD_BENCH_VENV). Prints the path of the venv's python on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
venv="${RESHARD_BENCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reshard/bench-venv}"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ ! -x "$py" ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
if ! "$py" -m pip install -q --disable-pip-version-check --upgrade --upgrade-strategy eager "$repo" >&2; then
  if ! "$py" -c "import numpy, google.protobuf" 2>/dev/null; then
    echo "bench_env.sh: could not install reshard's dependencies into $venv" >&2
    exit 1
  fi
  echo "bench_env.sh: warning: no upgrade (no package registry?): using $venv as it is" >&2
fi
echo "$py"
