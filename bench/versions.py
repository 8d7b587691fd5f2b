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


def dependency_versions(ms_python: str | None = None) -> dict[str, object]:
    """``{"python": ..., "numpy": ..., ...}`` for this interpreter (None: not installed), and under
    ``"mindspore_venv"`` the same for MindSpore's venv when ``ms_python`` is given."""
    found: dict[str, object] = {"python": platform.python_version()}
    found.update({name: _version(name) for name in DISTRIBUTIONS})
    if ms_python:
        proc = subprocess.run(
            [ms_python, "-c", _READ_VERSIONS, *MINDSPORE_DISTRIBUTIONS], capture_output=True, text=True, timeout=120
        )
        found["mindspore_venv"] = (
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0 and proc.stdout.strip()
            else {"error": proc.stderr.strip()[-300:]}
        )
    return found
