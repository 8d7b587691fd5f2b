"""The benchmark harness keeps working: a tiny model, one repeat, reshard and cp only (no MindSpore).

Speed is never asserted here (design.md): only that every operation runs, is verified against
its reference, and that the JSON, the charts and the markdown table are produced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
OPERATIONS = {
    "transform_ckpt",
    "transform_st",
    "merge_ckpt",
    "unify",
    "split",
    "dropin_transform",
    "convert",
    "dropin_merge",
    "dropin_unify",
    "dropin_split",
    "dropin_convert",
    "cp2_to_full",
    "ranks_to_cp2",
    "cp2_8to4",
    "hf_bf16",
    "hf_llama",
}

pytest.importorskip("psutil")  # in the [test] extra; matplotlib ([bench]) is optional: no charts without it
try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_run_tiny_model_reshard_and_cp(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(
        [
            str(BENCH / "run.py"),
            "--size",
            "8M",
            "--repeat",
            "1",
            "--no-mindspore",
            "--no-plan",
            "--no-profile",
            "--no-settle",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--scaling",
            "4M,8M",
            "--startup-repeat",
            "1",
            "--python",
            sys.executable,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    ops = results["main"]["operations"]
    assert {o["key"] for o in ops} == OPERATIONS
    for op in ops:
        assert op["verified_tensors"] > 0
        assert op["output_bytes"] > 0
        for contestant in ("reshard", "cp"):
            m = op[contestant]
            assert m["wall"] > 0 and 0 < m["call"] <= m["wall"] + 1e-6
            assert m["peak_rss"] >= m["maxrss"] > 0
        assert "mindspore" not in op
        assert op["ratios"]["reshard_cp_wall"] > 0
    assert [s["workload"]["target"] for s in results["scaling"]] == [4 * 2**20, 8 * 2**20]
    if HAVE_MATPLOTLIB:
        assert (out / "chart.png").stat().st_size > 0 and (out / "scaling.png").stat().st_size > 0
    assert "| transform 8→4 ranks (.ckpt) |" in proc.stdout
    assert not (tmp_path / "work" / "model-8M-fp32").exists()  # inputs removed without --keep
    assert results["meta"]["reshard_python"] == {"asked": sys.executable, "path": sys.executable}
    versions = results["meta"]["versions"]  # every figure traceable to what produced it (issue 19)
    expected = {"python", "numpy", "ml_dtypes", "protobuf", "cryptography", "rich", "xxhash", "blake3", "pyyaml"}
    assert expected <= set(versions)
    assert versions["numpy"] and versions["ml_dtypes"]
    rows = results["startup"]["rows"]
    for row in ('python -c "import numpy"', "reshard --version", "import reshard.cli", "import reshard.mindspore"):
        assert rows[row]["best"] > 0, row
    assert 0 < rows["small transform: first output file"]["best"] <= rows["small transform: whole run (10 MB)"]["best"]
    assert "Start-up (fresh processes" in proc.stdout
    assert not (tmp_path / "work" / "startup").exists()


def test_run_refuses_without_disk(tmp_path: Path) -> None:
    proc = _run(
        [
            str(BENCH / "run.py"),
            "--size",
            "100T",
            "--no-mindspore",
            "--no-plan",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert proc.returncode == 1
    assert "not enough free disk" in proc.stderr and proc.stderr.count("\n") == 1
    assert not [name for _, _, names in os.walk(tmp_path / "work") for name in names]  # nothing generated


def test_unknown_python_is_one_line(tmp_path: Path) -> None:
    args = ["--size", "8M", "--no-mindspore", "--no-plan", "--python", str(tmp_path / "no-such-python")]
    proc = _run([str(BENCH / "run.py"), *args, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert proc.returncode == 1
    assert "no such interpreter" in proc.stderr and proc.stderr.count("\n") == 1
    proc = _run([str(BENCH / "startup.py"), "--python", str(tmp_path / "no-such-python")])
    assert proc.returncode == 1
    assert "no such interpreter" in proc.stderr and proc.stderr.count("\n") == 1


def test_bench_venv_is_a_fresh_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--python fresh`` (the default): ``scripts/bench_env.sh`` makes a venv of its own with reshard's
    dependencies (not the base interpreter's site-packages), reused by the next call, and the
    versions recorded are that venv's."""
    sys.path.insert(0, str(BENCH))
    import interpreter
    import versions

    monkeypatch.setenv("RESHARD_BENCH_VENV", str(tmp_path / "venv"))
    python = interpreter.reshard_python()
    assert python == str(tmp_path / "venv" / "bin" / "python")
    probe = "import sys, numpy, google.protobuf; print(sys.prefix != sys.base_prefix)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env).stdout.strip() == "True"
    found = versions.dependency_versions(python=python)
    assert found["interpreter"] == python and found["numpy"] and found["protobuf"] and found["psutil"] is None
    assert interpreter.reshard_python() == python  # the second call refreshes the same venv


def test_plan_bench_small() -> None:
    proc = _run([str(BENCH / "plan_bench.py"), "--params", "20", "--ranks", "32", "--repeat", "1", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["versions"]["numpy"]
    assert result["tensors"] == 20 * 32 and result["copies"] >= result["tensors"]
    assert result["plan_seconds"] > 0 and result["layout_seconds"] > 0
    assert result["boxes_tensors"] == 20 * 32 and result["boxes_copies"] >= result["boxes_tensors"]  # the DCP-like row


def test_page_reporting_is_held_while_timing_and_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure.steady_host_memory``: the VM's free page reporting is held (order 11) while the runs are timed
    and put back after, even when the timing fails; without the module (or disabled) nothing is touched."""
    sys.path.insert(0, str(BENCH))
    import measure

    knob = tmp_path / "page_reporting_order"
    knob.write_text("9\n")
    monkeypatch.setattr(measure, "PAGE_REPORTING_ORDER", str(knob))
    monkeypatch.setattr(measure, "_prefault", lambda: 0)  # the real one touches all free memory
    with measure.steady_host_memory(True) as facts:
        assert knob.read_text() == measure.NO_REPORTING_ORDER
    assert facts == {"held": True, "order_was": "9", "prefaulted_bytes": 0}
    assert knob.read_text() == "9"
    with pytest.raises(RuntimeError), measure.steady_host_memory(True):
        raise RuntimeError("a contestant failed")
    assert knob.read_text() == "9"
    with measure.steady_host_memory(False) as facts:
        assert knob.read_text() == "9"
    assert facts == {"held": False}
    monkeypatch.setattr(measure, "PAGE_REPORTING_ORDER", str(tmp_path / "missing"))
    with measure.steady_host_memory(True) as facts:
        pass
    assert facts == {"held": False}
