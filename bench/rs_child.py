"""Child process of the benchmark: run one ``reshard`` CLI command (or drop-in call) and report its own timing.

A JSON list on argv[1] is a CLI command: it calls ``reshard.cli.main`` exactly as the ``reshard``
command does (same defaults: workers, memory bound), so the process is what a user runs. A JSON
object ``{"dropin": name, "args": [...], "kwargs": {...}}`` calls ``reshard.mindspore.<name>(**kwargs)`` instead:
what a script written for MindSpore runs after swapping its import. The only addition is the last
stdout line (``@@BENCH@@`` + JSON) with the time of the command after imports (``call``) and of the
imports. Usage: ``python3 bench/rs_child.py '["transform", "--src", ...]'``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RESULT_MARKER = "@@BENCH@@"
DROPIN_ALLOWED = ("transform_checkpoints", "unified_safetensors", "load_distributed_checkpoint", "ckpt_to_safetensors")


def load(job: list[str] | dict[str, Any]) -> Any:
    """Import what ``job`` runs; returns a function of no arguments that runs it (exit code)."""
    if isinstance(job, list):
        from reshard import cli

        return lambda: cli.main(job)
    if job.get("dropin") not in DROPIN_ALLOWED:
        raise SystemExit(f"rs_child: unknown drop-in function {job.get('dropin')!r}")
    from reshard import mindspore

    function = getattr(mindspore, job["dropin"])
    return lambda: function(*job.get("args", []), **job["kwargs"]) or 0


def main() -> int:
    job = json.loads(sys.argv[1])
    start = time.perf_counter()
    run = load(job)
    imported = time.perf_counter()
    code = run()
    done = time.perf_counter()
    print(RESULT_MARKER + json.dumps({"call": done - imported, "import": imported - start}), flush=True)
    return code


if __name__ == "__main__":
    status = main()
    if isinstance(json.loads(sys.argv[1]), list):
        # The ``reshard`` command ends with ``os._exit`` (reshard.entry): no interpreter teardown, so
        # neither does its timed stand-in. A drop-in call ends as a user's script does.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status if isinstance(status, int) else 1)
    sys.exit(status)
