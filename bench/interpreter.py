"""Which Python runs reshard in a benchmark: by default a fresh venv, as a new user has it.

    python3 bench/run.py                          # reshard in the bench venv (scripts/bench_env.sh)
    python3 bench/run.py --python "$(which python3)"   # in this environment instead

Why: a figure must be the one a user sees after ``pip install .``. A machine's base interpreter
carries whatever was put into its site-packages (this project's build VMs add a ``.pth`` file that
imports ``certifi`` in every Python process: ~9 ms of each reshard process, which neither ``cp`` nor
MindSpore, in a venv of its own, pays). ``scripts/bench_env.sh`` makes the venv in a cache folder
outside the checkout once and, at every bench run, upgrades each dependency to its newest release,
so the figures also catch a release that slows reshard down (the versions go into the results).

The code measured is always this checkout's: the children get ``src`` on ``PYTHONPATH``
(``run.child_env``); the venv contributes the interpreter's start-up and the dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_ENV_SCRIPT = os.path.join(REPO, "scripts", "bench_env.sh")
FRESH = "fresh"
PYTHON_HELP = (
    "the Python that runs reshard: 'fresh' (default) is the bench venv, a fresh 'pip install .' with the "
    "newest release of every dependency (scripts/bench_env.sh); or a path or command, e.g. python3"
)


class InterpreterError(RuntimeError):
    """The requested Python cannot run reshard (one line for the bench's error message)."""


def reshard_python(choice: str = FRESH) -> str:
    """The absolute path of the interpreter ``choice`` names (``fresh``: the bench venv, made or refreshed)."""
    if choice == FRESH:
        proc = subprocess.run(["bash", BENCH_ENV_SCRIPT], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["no output"]
            raise InterpreterError(f"the bench venv could not be set up: {lines[-1]}")
        return proc.stdout.strip().splitlines()[-1]
    found = shutil.which(choice)
    if found is None:
        raise InterpreterError(f"--python {choice}: no such interpreter")
    return os.path.abspath(found)


__all__ = ["FRESH", "PYTHON_HELP", "InterpreterError", "reshard_python"]
