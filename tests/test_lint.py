"""The code stays ruff-clean: checked as part of the suite so CI enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.oracle import ROOT


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    proc = subprocess.run([*cmd, "check", "src", "tests", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
