"""Child process of the benchmark: run one ``reshard`` CLI command and report its own timing.

It calls ``reshard.cli.main`` exactly as the ``reshard`` command does (same defaults: workers,
memory bound), so the process is what a user runs; the only addition is the last stdout line
(``@@BENCH@@`` + JSON) with the time of the command after imports (``call``) and of the imports.
Usage: ``python3 bench/rs_child.py '["transform", "--src", ...]'``.
"""

from __future__ import annotations

import json
import sys
import time

RESULT_MARKER = "@@BENCH@@"


def main() -> int:
    argv = json.loads(sys.argv[1])
    start = time.perf_counter()
    from reshard import cli

    imported = time.perf_counter()
    code = cli.main(argv)
    done = time.perf_counter()
    print(RESULT_MARKER + json.dumps({"call": done - imported, "import": imported - start}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
