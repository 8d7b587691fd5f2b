"""The versions a benchmark figure was produced with: Python, every dependency of reshard, and MindSpore.

Why: a dependency's release can move every figure without a line of reshard changing (``ml_dtypes``
0.7.0 added about a second to each process's start-up until reshard stopped importing it at start),
so each results file records what was installed. Versions are read from the installed distributions'
metadata (``importlib.metadata``), which imports nothing: recording them cannot change what is
measured. MindSpore lives in its own venv, so its versions are read by that venv's python.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess

# reshard's dependencies (pyproject.toml), then the optional ones a run may load.
DISTRIBUTIONS = (
    "numpy",
    "ml_dtypes",
    "protobuf",
    "cryptography",
    "rich",
    "xxhash",
    "blake3",
    "pyyaml",
    "psutil",
    "matplotlib",
    "ray",
)
MINDSPORE_DISTRIBUTIONS = ("mindspore", "mindformers", "numpy", "safetensors")

_READ_VERSIONS = (
    "import importlib.metadata as m, json, platform, sys\n"
    "def v(n):\n"
    "    try:\n"
    "        return m.version(n)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({'python': platform.python_version(), **{n: v(n) for n in sys.argv[1:]}}))\n"
)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dependency_versions(ms_python: str | None = None, python: str | None = None) -> dict[str, object]:
    """``{"python": ..., "numpy": ..., ...}`` for the interpreter that runs reshard (``python``, read by
    that interpreter; None: this one; a dependency not installed is None), and under ``"mindspore_venv"``
    the same for MindSpore's venv when ``ms_python`` is given."""
    found: dict[str, object]
    if python is None:
        found = {"python": platform.python_version()}
        found.update({name: _version(name) for name in DISTRIBUTIONS})
    else:
        found = {**_read_in(python, DISTRIBUTIONS), "interpreter": python}
    if ms_python:
        found["mindspore_venv"] = _read_in(ms_python, MINDSPORE_DISTRIBUTIONS)
    return found


def _read_in(python: str, names: tuple[str, ...]) -> dict[str, object]:
    """The versions of ``names`` (and Python's) as the interpreter ``python`` sees them."""
    proc = subprocess.run([python, "-c", _READ_VERSIONS, *names], capture_output=True, text=True, timeout=120)
    if proc.returncode == 0 and proc.stdout.strip():
        found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return found
    return {"error": proc.stderr.strip()[-300:]}
