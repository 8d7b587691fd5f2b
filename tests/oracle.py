"""Run code inside the MindSpore 2.10 oracle virtual environment, as a subprocess.

The package never imports MindSpore. Oracle tests write inputs with numpy, run a small script in
the oracle venv (created once by ``scripts/oracle_env.sh`` in a cache folder outside the
checkout), and compare files/tensors. Scripts receive JSON on argv[1] and print JSON on the last
line of stdout.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV_SCRIPT = ROOT / "scripts" / "oracle_env.sh"

PRELUDE = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
os.environ.setdefault("GLOG_v", "3")
import numpy as np
import mindspore as ms
ARGS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
def out(obj):
    print("\\n@@ORACLE@@" + json.dumps(obj))
"""


@functools.cache
def oracle_python() -> str:
    """Path of the oracle venv's python, creating the venv on first use (several minutes)."""
    proc = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"oracle venv set-up failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_oracle(code: str, args: Any = None, timeout: float = 900, cwd: str | None = None) -> Any:
    """Run ``code`` (with PRELUDE: ms, np, ARGS, out()) in the oracle venv; return what it out()s.

    ``cwd`` is the subprocess's working directory (MindFormers writes ./output/log there).
    """
    script = PRELUDE + textwrap.dedent(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["GLOG_v"] = "3"
    proc = subprocess.run(
        [oracle_python(), "-c", script, json.dumps(args if args is not None else {})],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"oracle script failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    marker = proc.stdout.rfind("@@ORACLE@@")
    if marker < 0:
        return None
    return json.loads(proc.stdout[marker + len("@@ORACLE@@") :].strip())
