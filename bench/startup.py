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
from collections.abc import Sequence
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)

import interpreter  # noqa: E402
import versions  # noqa: E402

POLL_SECONDS = 0.001
NUMPY_ROW = 'python -c "import numpy"'
FIRST_FILE = "small transform: first output file"
SMALL_RUN = "small transform: whole run (10 MB)"
DEFAULT_REPEAT = 20
_ENTRY = "import sys; from reshard.cli import main; sys.exit(main(sys.argv[1:]))"  # the console script


def child_env() -> dict[str, str]:
    """No PYTHON* variable of ours (bytecode caching on), this checkout's reshard, one BLAS thread off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    return env


def _timed(argv: Sequence[str], env: dict[str, str], watch: str | None = None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the child, seconds until a file appeared under ``watch``).

    CPU time (user + system, from ``wait4``) is what start-up costs the machine and moves little
    when other work slows the clock; the wall time is what a user waits. Without ``watch`` the third
    value is the wall time.
    """
    if watch is not None:
        shutil.rmtree(watch, ignore_errors=True)
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
        first = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if watch is not None else 0)
            if pid:
                break
            if first is None and watch is not None and os.path.isdir(watch) and _first_file(watch):
                first = time.perf_counter() - start
            time.sleep(POLL_SECONDS)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {err.read().decode()[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime, (first if first is not None else wall)


def _first_file(folder: str) -> bool:
    """Whether an output file (its temporary name included) exists: the lock and journal do not count."""
    for _, _, names in os.walk(folder):
        if any(name.endswith((".ckpt", ".safetensors", ".reshard-tmp")) for name in names):
            return True
    return False


def _demo(work: str, env: dict[str, str], py: str) -> str:
    demo = os.path.join(work, "demo")
    if not os.path.isdir(os.path.join(demo, "ckpt_8ranks")):
        shutil.rmtree(demo, ignore_errors=True)
        subprocess.run([py, "-c", _ENTRY, "demo", "--dir", demo], env=env, check=True, capture_output=True)
    return demo


def measure_startup(repeat: int = DEFAULT_REPEAT, work: str | None = None, python: str | None = None) -> dict[str, Any]:
    """Every row's times (seconds), best and median, plus the dependency versions they ran with; in
    the interpreter ``python`` (default: this one)."""
    env = child_env()
    owned = work is None
    work = work or tempfile.mkdtemp(prefix="reshard-startup-")
    py = python or sys.executable
    try:
        demo = _demo(work, env, py)
        dst = os.path.join(work, "small_transform_out")
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
        argvs = {
            "python -c pass": [py, "-c", "pass"],
            'python -c "import numpy"': [py, "-c", "import numpy"],
            "reshard --version": [py, "-c", _ENTRY, "--version"],
            "reshard transform --help": [py, "-c", _ENTRY, "transform", "--help"],
            "import reshard.cli": [py, "-c", "import reshard.cli"],
            "import reshard.mindspore": [py, "-c", "import reshard.mindspore"],
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in (*argvs, FIRST_FILE, SMALL_RUN)}
        for rep in range(repeat + 1):  # run 0 warms the caches (bytecode, page cache) and is dropped
            for name, argv in argvs.items():
                wall, cpu, _ = _timed(argv, env)
                if rep:
                    samples[name].append((wall, cpu))
            wall, cpu, first = _timed(transform, env, watch=dst)
            if rep:
                samples[FIRST_FILE].append((first, float("nan")))
                samples[SMALL_RUN].append((wall, cpu))
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    rows = {name: _row(values) for name, values in samples.items()}
    numpy = rows['python -c "import numpy"']
    return {
        "repeat": repeat,
        "rows": rows,
        "targets": {
            "version_vs_numpy": rows["reshard --version"]["best"] / numpy["best"],
            "cli_import_minus_numpy": rows["import reshard.cli"]["best"] - numpy["best"],
            "dropin_import_minus_numpy": rows["import reshard.mindspore"]["best"] - numpy["best"],
            "version_vs_numpy_cpu": rows["reshard --version"]["cpu_best"] / numpy["cpu_best"],
            "cli_import_minus_numpy_cpu": rows["import reshard.cli"]["cpu_best"] - numpy["cpu_best"],
            "dropin_import_minus_numpy_cpu": rows["import reshard.mindspore"]["cpu_best"] - numpy["cpu_best"],
        },
        "versions": versions.dependency_versions(python=py),
    }


def _row(values: list[tuple[float, float]]) -> dict[str, Any]:
    walls, cpus = [w for w, _ in values], [c for _, c in values if c == c]  # NaN: not measured
    row: dict[str, Any] = {"best": min(walls), "median": statistics.median(walls), "runs": walls}
    if cpus:
        row.update(cpu_best=min(cpus), cpu_median=statistics.median(cpus), cpu_runs=cpus)
    return row


def markdown(startup: dict[str, Any]) -> list[str]:
    rows = startup["rows"]
    numpy = rows['python -c "import numpy"']
    lines = [
        f"Start-up (fresh processes, page cache warm, best and median of {startup['repeat']}; CPU is the "
        "child's user + system time, which other work on the machine moves far less than the wall time):",
        "",
        "| process | wall best | wall median | wall − `import numpy` | CPU best | CPU − `import numpy` |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        cpu = (
            f"{row['cpu_best']:.3f} s | {row['cpu_best'] - numpy['cpu_best']:+.3f} s" if "cpu_best" in row else "— | —"
        )
        lines.append(
            f"| `{name}` | {row['best']:.3f} s | {row['median']:.3f} s | {row['best'] - numpy['best']:+.3f} s | {cpu} |"
        )
    t = startup["targets"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    imports = max(t["cli_import_minus_numpy"], t["dropin_import_minus_numpy"])
    imports_cpu = max(t["cli_import_minus_numpy_cpu"], t["dropin_import_minus_numpy_cpu"])
    lines += [
        "",
        f"Targets (wall; CPU): `reshard --version` ≤ `import numpy`: {t['version_vs_numpy']:.2f}× "
        f"({verdict(t['version_vs_numpy'] <= 1)}); {t['version_vs_numpy_cpu']:.2f}× "
        f"({verdict(t['version_vs_numpy_cpu'] <= 1)}). Importing the CLI / the drop-in ≤ numpy + 0.15 s: "
        f"{t['cli_import_minus_numpy']:+.3f} s / {t['dropin_import_minus_numpy']:+.3f} s ({verdict(imports <= 0.15)}); "
        f"{t['cli_import_minus_numpy_cpu']:+.3f} s / {t['dropin_import_minus_numpy_cpu']:+.3f} s "
        f"({verdict(imports_cpu <= 0.15)}).",
    ]
    return lines


def readme_line(startup: dict[str, Any]) -> str:
    """The README's start-up sentence, from the ``startup`` rows of a results file."""
    rows = startup["rows"]

    def best(name: str) -> str:
        return f"{rows[name]['best']:.3f} s"

    return (
        f"`reshard --version` {best('reshard --version')} and `import reshard.mindspore` "
        f"{best('import reshard.mindspore')}, against {best(NUMPY_ROW)} for `import numpy`"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/startup.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"runs per row (default {DEFAULT_REPEAT})")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--out", help="also write them to this file, with the command, commit and dependency versions")
    p.add_argument("--python", default=interpreter.FRESH, help=interpreter.PYTHON_HELP)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        python = interpreter.reshard_python(args.python)
    except interpreter.InterpreterError as exc:
        print(f"bench/startup.py: error: {exc}", file=sys.stderr)
        return 1
    result = measure_startup(args.repeat, python=python)
    print(json.dumps(result, indent=1) if args.json else "\n".join(markdown(result)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"meta": _meta(argv, python), "startup": result}, fh, indent=1)
    return 0


def _meta(argv: Sequence[str] | None, python: str) -> dict[str, Any]:
    """What produced the figures: the command, the commit (and package files changed since), the versions."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout

    words = sys.argv[1:] if argv is None else list(argv)
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines() if len(line) > 3]
    return {
        "command": " ".join(["python3 bench/startup.py", *words]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git("rev-parse", "HEAD").strip(),
        "git_dirty_files": dirty,
        "cpus": os.cpu_count(),
        "versions": versions.dependency_versions(python=python),
    }


if __name__ == "__main__":
    sys.exit(main())
