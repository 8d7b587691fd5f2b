"""Run a script in one of the test virtual environments (MindSpore's, transformers'), as a subprocess.

The package never imports MindSpore, MindFormers, torch or transformers: each lives in its own venv,
made once by a script of the project (``scripts/oracle_env.sh``, ``scripts/hf_env.sh``) in a cache
folder outside the checkout. Scripts receive JSON on argv[1] and print JSON after a marker on the
last line of stdout; ``tests/oracle.py`` and ``tests/hf.py`` give each venv its prelude and marker.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any


@functools.cache
def venv_python(env_script: Path) -> str:
    """Path of the venv's python that ``env_script`` prints, creating the venv on first use (minutes)."""
    proc = subprocess.run(["bash", str(env_script)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{env_script.name} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_script(
    python: str,
    prelude: str,
    marker: str,
    code: str,
    args: Any = None,
    *,
    timeout: float,
    env: dict[str, str],
    cwd: str | None = None,
) -> Any:
    """Run ``prelude + code`` with ``python``; return the JSON printed after ``marker`` (None without one).

    The test process's ``PYTHON*`` variables are not passed on (they would point the venv's python
    at this checkout's packages); ``env`` is added to what is left.
    """
    script = prelude + textwrap.dedent(code)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | env
    proc = subprocess.run(
        [python, "-c", script, json.dumps(args if args is not None else {})],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=cwd,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"script failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    at = proc.stdout.rfind(marker)
    if at < 0:
        return None
    return json.loads(proc.stdout[at + len(marker) :].strip())
