"""Run code inside the MindSpore 2.10 oracle virtual environment, as a subprocess.

The package never imports MindSpore. Oracle tests write inputs with numpy, run a small script in
the oracle venv (created once by ``scripts/oracle_env.sh`` in a cache folder outside the
checkout), and compare files/tensors. Scripts receive JSON on argv[1] and print JSON on the last
line of stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.subvenv import run_script, venv_python

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


def oracle_python() -> str:
    """Path of the oracle venv's python, creating the venv on first use (several minutes)."""
    return venv_python(ENV_SCRIPT)


def run_oracle(code: str, args: Any = None, timeout: float = 900, cwd: str | None = None) -> Any:
    """Run ``code`` (with PRELUDE: ms, np, ARGS, out()) in the oracle venv; return what it out()s.

    ``cwd`` is the subprocess's working directory (MindFormers writes ./output/log there).
    """
    return run_script(oracle_python(), PRELUDE, "@@ORACLE@@", code, args, timeout=timeout, env={"GLOG_v": "3"}, cwd=cwd)
