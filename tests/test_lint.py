"""The code stays clean: ruff (lint and format) and mypy, pinned in the test extra, run as part of the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.oracle import ROOT

PATHS = ["src", "tests", "bench"]


def _tool(name: str) -> list[str]:
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", name]


def test_ruff_clean() -> None:
    proc = subprocess.run([*_tool("ruff"), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_formatted() -> None:
    proc = subprocess.run([*_tool("ruff"), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, "run `ruff format src tests bench`:\n" + proc.stdout + proc.stderr


def test_mypy_clean() -> None:
    """``[tool.mypy]`` in pyproject.toml says what is checked (``src/reshard``) and how."""
    proc = subprocess.run([*_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
