"""Child process of the benchmark, run by the MindSpore 2.10 oracle venv's python.

Runs one MindSpore converter call (``{"fn": name, "args": [...], "kwargs": {...}}`` on argv[1])
and prints, on its last stdout line, ``@@BENCH@@`` + JSON with the time of the call after
``import mindspore`` (``call``) and of the import. Only the standard library and MindSpore are
used: this file runs outside the reshard environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

RESULT_MARKER = "@@BENCH@@"
ALLOWED = ("transform_checkpoints", "unified_safetensors", "load_distributed_checkpoint", "ckpt_to_safetensors")


def main() -> int:
    job = json.loads(sys.argv[1])
    if job["fn"] not in ALLOWED:
        raise SystemExit(f"ms_child: unknown function {job['fn']!r}")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOG_v", "3")
    start = time.perf_counter()
    import mindspore as ms

    imported = time.perf_counter()
    getattr(ms, job["fn"])(*job.get("args", []), **job.get("kwargs", {}))
    done = time.perf_counter()
    print(RESULT_MARKER + json.dumps({"call": done - imported, "import": imported - start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
