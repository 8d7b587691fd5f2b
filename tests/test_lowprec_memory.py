"""``--dequantize`` and ``--quantize`` of a tensor larger than ``--max-memory``: it streams in row blocks.

One 8192 x 8192 FP8 weight (64 MiB; 128 MiB as bf16) with ``--max-memory 16MiB``: the peak RSS of the
reshard process stays below the one tensor's bf16 size (whole, it alone would be 128 MiB on top of
Python and numpy), and the bytes are those of a run with memory to spare.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.lowprec_fixtures import fp8_model
from tests.trust_helpers import run_cli

ROWS = COLS = 8192
BF16_BYTES = ROWS * COLS * 2
PEAK = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " + (
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _peak_rss(*args: str) -> int:
    """Bytes of the peak RSS of ``python -m reshard ARGS`` (run by a child of its own, alone in its rusage)."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, sys.executable, "-m", "reshard.cli", *args, "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) * 1024  # ru_maxrss: KiB on Linux


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(3)
    weight = rng.integers(0, 0x7E, (ROWS, COLS), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = (rng.random((ROWS // 128, COLS // 128), dtype=np.float32) * 1e-3).astype(np.float32)
    return fp8_model(
        tmp_path_factory.mktemp("lowprec-memory") / "fp8", {"a.weight": weight, "a.weight_scale_inv": scale}
    )


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB")
def test_a_tensor_larger_than_max_memory_streams_in_row_blocks(big: Path, tmp_path: Path) -> None:
    deq, spare = tmp_path / "deq", tmp_path / "spare"
    peak = _peak_rss("transform", str(big), str(deq), "--hf", "--dequantize", "bf16", "--max-memory", "16MiB")
    assert peak < BF16_BYTES, peak
    assert run_cli("transform", str(big), str(spare), "--hf", "--dequantize", "bf16").returncode == 0
    assert (deq / "model.safetensors").read_bytes() == (spare / "model.safetensors").read_bytes()
    q, q_spare = tmp_path / "q", tmp_path / "q_spare"
    peak = _peak_rss("transform", str(deq), str(q), "--hf", "--quantize", "fp8-block", "--max-memory", "16MiB")
    assert peak < BF16_BYTES, peak
    assert run_cli("transform", str(deq), str(q_spare), "--hf", "--quantize", "fp8-block").returncode == 0
    assert (q / "model.safetensors").read_bytes() == (q_spare / "model.safetensors").read_bytes()
