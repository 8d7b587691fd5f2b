# Shared by the scripts that make the test virtual environments (hf_env.sh, torch_env.sh): make a venv
# once, from a pinned requirements file, under a lock, and mark it complete. Sourced, not run.
#
# ensure_venv VENV MARKER REQUIREMENTS CHECK
#   VENV: the venv's folder (in a cache folder outside the checkout, reused by every clone);
#   MARKER: a file inside it whose presence says the venv is complete (its name carries the pins, so
#     a change of pins makes a new venv);
#   REQUIREMENTS: the pinned requirements file pip installs;
#   CHECK: Python code the new venv must run without error (the imports and versions it is for).
# A lock (VENV.lock) serialises concurrent first uses (parallel test workers); a half-made venv is
# removed and made again. Prints nothing: the caller prints the python's path.
ensure_venv() {
  local venv="$1" marker="$2" requirements="$3" check="$4"
  local py="$venv/bin/python"
  [[ -f "$marker" ]] && return 0
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9
  if [[ ! -f "$marker" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
    "$py" -c "$check" >&2
    touch "$marker"
  fi
  exec 9>&-
}
