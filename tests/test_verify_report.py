"""verify tells what differs and where, in one line per tensor on a pipe, and stays quiet on a match."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reshard.formats.safetensors import save_safetensors
from reshard.verify import _first_difference
from tests.trust_helpers import run_cli

LONG = "model.decoder.layers.17.self_attention.linear_qkv.layer_norm_weight.with_a_very_long_suffix_for_grep"


def _pair(tmp: Path, change: bool) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    tensors = {"wq": rng.standard_normal((6, 4)).astype(np.float32), LONG: np.arange(5, dtype=np.int32)}
    a, b = str(tmp / "a.safetensors"), str(tmp / "b.safetensors")
    save_safetensors(a, tensors, {"format": "ms"})
    if change:
        tensors = {**tensors, "wq": tensors["wq"].copy()}
        tensors["wq"][4, 1] += 0.5
    save_safetensors(b, tensors, {"format": "ms"})
    return a, b


def test_same_is_one_summary_line(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, change=False)
    proc = run_cli("verify", a, b)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [
        "SAME: 2 match, 0 differ, 0 missing (only in A), 0 unexpected (only in B)"
    ]


def test_a_difference_is_named_with_its_first_index(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, change=True)
    proc = run_cli("verify", a, b)
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "differ  wq  Float32  [6, 4]  max |a-b| 0.5  values differ, first at [4, 1]"
    assert lines[1].startswith("DIFFERENT: 1 match, 1 differ") and len(lines) == 2
    data = json.loads(run_cli("verify", a, b, "--json").stdout)
    (wq,) = [t for t in data["tensors"] if t["name"] == "wq"]
    assert wq["first_index"] == [4, 1] and wq["status"] == "differ"


def test_all_lists_every_name_whole_on_one_line(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, change=True)
    lines = run_cli("verify", a, b, "--all").stdout.splitlines()
    assert any(line.startswith(f"match  {LONG}  Int32  [5]") for line in lines), lines
    assert sum(line.startswith(("match", "differ")) for line in lines) == 2


def test_first_difference() -> None:
    a = np.zeros((3, 4), np.float32)
    b = a.copy()
    assert _first_difference(a, b, 0.0) is None
    b[2, 1] = 1e-3
    b[2, 3] = 1.0
    assert _first_difference(a, b, 0.0) == (2, 1)
    assert _first_difference(a, b, 0.01) == (2, 3)  # within the tolerance at [2, 1]
    b[:] = 0
    b[0, 0] = -0.0  # the same value, other bytes: an exact compare (no tolerance) finds it
    assert _first_difference(a, b, 0.0) == (0, 0)
    nan = np.full((2,), np.nan, np.float32)
    assert _first_difference(nan, nan.astype(np.float64), 0.0) is None  # NaN against NaN is equal
    assert _first_difference(np.float32(1.0).reshape(()), np.float32(2.0).reshape(()), 0.0) == ()
