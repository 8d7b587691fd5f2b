"""Start-up: what a reshard process costs before it moves a byte, beside ``python -c "import numpy"``.

    python3 bench/startup.py                  # best of 20 per row, a markdown table
    python3 bench/startup.py --repeat 50 --json

Rows (each a fresh process, as a user starts it; run.py adds them to its results as ``startup``):

* ``python -c pass`` and ``python -c "import numpy"``: the interpreter, and the yardstick of the
  targets (``reshard --version`` no slower than importing numpy; importing the CLI or the drop-in
  within numpy + 0.15 s).
* ``reshard --version``, ``reshard transform --help``: called as the ``reshard`` console script calls
  ``reshard.cli.main``.
* ``import reshard.cli``, ``import reshard.mindspore``: what a script pays for the import.
* A small transform (the demo's 8-rank ``.ckpt``, about 10 MB, to 4 ranks): the time until its first
  output file appears in the destination, under its temporary name (polled every millisecond:
  start-up, opening the sources and planning; the first bytes go in as it is created), and its whole
  wall time (start-up dominates at this size).

Why these conditions: start-up is the cost of loading code, so the interpreter, the libraries and
the demo's inputs are in the page cache (one untimed warm-up run of each row also writes the
bytecode caches, as ``pip install`` does; no ``PYTHON*`` variable is passed on, so
``PYTHONDONTWRITEBYTECODE`` cannot turn every run into a compile). Rows are interleaved run by run
so that load from other work hits them alike; the best and the median are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)

import versions  # noqa: E402

POLL_SECONDS = 0.001
DEFAULT_REPEAT = 20
_ENTRY = "import sys; from reshard.cli import main; sys.exit(main(sys.argv[1:]))"  # the console script


def child_env() -> dict[str, str]:
    """No PYTHON* variable of ours (bytecode caching on), this checkout's reshard, one BLAS thread off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    return env


def _wall(argv: Sequence[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return wall


def _first_file(folder: str) -> bool:
    """Whether an output file (its temporary name included) exists: the lock and journal do not count."""
    for _, _, names in os.walk(folder):
        if any(name.endswith((".ckpt", ".safetensors", ".reshard-tmp")) for name in names):
            return True
    return False


def _transform_times(argv: Sequence[str], dst: str, env: dict[str, str]) -> tuple[float, float]:
    """(seconds until the first file appears under ``dst``, seconds until the process ends)."""
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while proc.poll() is None:
        if first is None and os.path.isdir(dst) and _first_file(dst):
            first = time.perf_counter() - start
        time.sleep(POLL_SECONDS)
    wall = time.perf_counter() - start
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"small transform: exit {proc.returncode}: {err.decode()[-500:]}")
    return (first if first is not None else wall), wall


def _demo(work: str, env: dict[str, str]) -> str:
    demo = os.path.join(work, "demo")
    if not os.path.isdir(os.path.join(demo, "ckpt_8ranks")):
        shutil.rmtree(demo, ignore_errors=True)
        subprocess.run([sys.executable, "-c", _ENTRY, "demo", "--dir", demo], env=env, check=True, capture_output=True)
    return demo


def measure_startup(repeat: int = DEFAULT_REPEAT, work: str | None = None) -> dict[str, Any]:
    """Every row's times (seconds), best and median, plus the dependency versions they ran with."""
    env = child_env()
    owned = work is None
    work = work or tempfile.mkdtemp(prefix="reshard-startup-")
    try:
        demo = _demo(work, env)
        dst = os.path.join(work, "small_transform_out")
        py = sys.executable
        transform = [
            py,
            "-c",
            _ENTRY,
            "transform",
            "--src",
            os.path.join(demo, "ckpt_8ranks"),
            "--dst",
            dst,
            "--src-strategy",
            os.path.join(demo, "merged", "src_strategy.ckpt"),
            "--dst-strategy",
            os.path.join(demo, "merged", "dst_strategy.ckpt"),
            "-q",
        ]
        timed: dict[str, Callable[[], float]] = {
            "python -c pass": lambda: _wall([py, "-c", "pass"], env),
            'python -c "import numpy"': lambda: _wall([py, "-c", "import numpy"], env),
            "reshard --version": lambda: _wall([py, "-c", _ENTRY, "--version"], env),
            "reshard transform --help": lambda: _wall([py, "-c", _ENTRY, "transform", "--help"], env),
            "import reshard.cli": lambda: _wall([py, "-c", "import reshard.cli"], env),
            "import reshard.mindspore": lambda: _wall([py, "-c", "import reshard.mindspore"], env),
        }
        samples: dict[str, list[float]] = {name: [] for name in timed}
        samples["small transform: first output file"] = []
        samples["small transform: whole run (10 MB)"] = []
        for rep in range(repeat + 1):  # run 0 warms the caches (bytecode, page cache) and is dropped
            for name, run in timed.items():
                seconds = run()
                if rep:
                    samples[name].append(seconds)
            first, wall = _transform_times(transform, dst, env)
            if rep:
                samples["small transform: first output file"].append(first)
                samples["small transform: whole run (10 MB)"].append(wall)
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    rows = {
        name: {"best": min(values), "median": statistics.median(values), "runs": values}
        for name, values in samples.items()
    }
    numpy = rows['python -c "import numpy"']["best"]
    return {
        "repeat": repeat,
        "rows": rows,
        "targets": {
            "version_vs_numpy": rows["reshard --version"]["best"] / numpy,
            "cli_import_minus_numpy": rows["import reshard.cli"]["best"] - numpy,
            "dropin_import_minus_numpy": rows["import reshard.mindspore"]["best"] - numpy,
        },
        "versions": versions.dependency_versions(),
    }


def markdown(startup: dict[str, Any]) -> list[str]:
    rows = startup["rows"]
    numpy = rows['python -c "import numpy"']["best"]
    lines = [
        f"Start-up (fresh processes, page cache warm, best and median of {startup['repeat']}):",
        "",
        "| process | best | median | best − `import numpy` |",
        "|---|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(f"| `{name}` | {row['best']:.3f} s | {row['median']:.3f} s | {row['best'] - numpy:+.3f} s |")
    t = startup["targets"]
    lines += [
        "",
        f"Targets: `reshard --version` ≤ `import numpy`: {t['version_vs_numpy']:.2f}× "
        f"({'met' if t['version_vs_numpy'] <= 1 else 'MISSED'}); importing the CLI / the drop-in ≤ numpy + 0.15 s: "
        f"{t['cli_import_minus_numpy']:+.3f} s / {t['dropin_import_minus_numpy']:+.3f} s "
        f"({'met' if max(t['cli_import_minus_numpy'], t['dropin_import_minus_numpy']) <= 0.15 else 'MISSED'}).",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/startup.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"runs per row (default {DEFAULT_REPEAT})")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    result = measure_startup(args.repeat)
    print(json.dumps(result, indent=1) if args.json else "\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
