"""Run PyTorch (the oracle for DCP checkpoints) in its own venv, as subprocesses.

The package never imports torch. The DCP tests save real checkpoints with
``torch.distributed.checkpoint`` on several gloo ranks (``torchrun``, CPU) and load reshard's outputs
back with it, in the venv ``scripts/torch_env.sh`` makes once in a cache folder outside the checkout
(torch 2.13.0 CPU, megatron-core, psutil). Scripts live in ``tests/oracle_scripts/dcp_*.py``; they take
JSON on argv[1] and write their results as files (``.npz`` tensors, ``.json`` values).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.subvenv import venv_python

ROOT = Path(__file__).resolve().parent.parent
ENV_SCRIPT = ROOT / "scripts" / "torch_env.sh"
SCRIPTS = ROOT / "tests" / "oracle_scripts"


def torch_python() -> str:
    """Path of the PyTorch venv's python, creating the venv on first use (about a minute)."""
    return venv_python(ENV_SCRIPT)


def run_torch_script(script: str, args: Any, *, nproc: int | None = None, timeout: float = 600) -> None:
    """Run ``tests/oracle_scripts/<script>`` in the venv: alone, or under ``torchrun`` with ``nproc`` gloo ranks.

    The test process's ``PYTHON*`` variables are not passed on (they would point the venv's python at
    this checkout); one OpenMP thread per rank keeps a 2-core machine responsive.
    """
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [torch_python(), *launcher, str(SCRIPTS / script), json.dumps(args)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    if proc.returncode != 0 and nproc is not None and _rank_killed_by_signal(proc.stderr):
        # Once in CI (session 13) a gloo rank aborted at start-up under load ("terminate called without an
        # active exception", SIGABRT) and the same launch then passed four times in a row: a rank killed by
        # a signal, not by a Python error of the script, is launched once more.
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _rank_killed_by_signal(stderr: str) -> bool:
    """torchrun's root cause is a rank that died of a signal (a negative exit code), not one that raised."""
    root = stderr.rpartition("Root Cause")[2]
    found = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    return found is not None and int(found.group(1)) < 0
