"""The published speed figures are the recorded ones.

The README's speed table and start-up sentence and the cold-cache tables of docs/benchmarks.md
are rendered from the results files in ``docs/bench/`` (``bench/run.py``'s, and ``bench/startup.py
--out``'s) by ``bench/report.py`` and ``bench/startup.py``, so a figure cannot drift from the run
that produced it. Each results file names its command, its commit (an ancestor of this checkout)
and every dependency's version, so a figure can be traced to what produced it (a dependency's
release once made every process 1.2 s slower and nothing noticed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench"
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402
import startup  # noqa: E402

FP32, BF16, STARTUP = "results-cold.json", "results-bf16.json", "results-startup.json"
DEPENDENCIES = ("python", "numpy", "ml_dtypes", "protobuf", "cryptography")


def _load(name: str) -> dict[str, Any]:
    results: dict[str, Any] = json.loads((RESULTS / name).read_text())
    for op in results.get("main", {}).get("operations", []):
        op["ratios"] = report.ratios(op)  # recomputed from the runs, not trusted from the file
    return results


@pytest.mark.parametrize("name", [FP32, BF16, STARTUP])
def test_results_trace_to_a_commit_and_versions(name: str) -> None:
    meta = _load(name)["meta"]
    assert meta["command"].startswith("python3 bench/startup.py" if name == STARTUP else "python3 bench/run.py")
    assert not meta["git_dirty_files"], "measured with uncommitted package changes"
    assert all(meta["versions"].get(dep) for dep in DEPENDENCIES), meta["versions"]
    ancestor = subprocess.run(
        ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", meta["git_commit"], "HEAD"], capture_output=True
    )
    if ancestor.returncode not in (0, 1):
        pytest.skip("not a git checkout with history")  # a source tarball: nothing to trace against
    assert ancestor.returncode == 0, f"{meta['git_commit']} is not in this checkout's history"


@pytest.mark.parametrize("name", [FP32, BF16])
def test_benchmarks_page_tables_are_the_results(name: str) -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    results = _load(name)
    for line in report.main_table(results["main"]):
        assert line in page, f"docs/benchmarks.md lacks the row of {name}: {line}"
    assert results["meta"]["command"] in page


def test_readme_speed_figures_are_the_results() -> None:
    readme = (ROOT / "README.md").read_text()
    fp32, bf16 = _load(FP32), _load(BF16)
    for line in report.summary_table(fp32["main"], bf16["main"]):
        assert line in readme, f"README.md lacks the speed row: {line}"
    assert startup.readme_line(_load(STARTUP)["startup"]) in readme
