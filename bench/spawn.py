"""Smallest possible parent for a measured process: fork, exec, ``wait4``, report.

Linux keeps a process's RSS high-water mark across ``exec``, and a freshly forked child's RSS is
its parent's. So a contestant started straight from the benchmark (a Python process holding
numpy, matplotlib, psutil: ~50 MB) would inherit that as its ``ru_maxrss`` floor. This wrapper
runs as ``python3 -I -S`` (no site packages, ~9 MB), which becomes the floor instead; it also
takes the wall time from just before ``fork`` to the reap, without the wrapper's own start-up.
Usage: ``python3 -I -S bench/spawn.py RESULT.json argv...``; exit status 0 unless it failed itself.
"""

import json
import os
import sys
import time

EXEC_FAILED = 127


def main() -> int:
    result_path, argv = sys.argv[1], sys.argv[2:]
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(EXEC_FAILED)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"wall": wall, "maxrss_kib": usage.ru_maxrss, "exit": os.waitstatus_to_exitcode(status)}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
