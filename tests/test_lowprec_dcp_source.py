"""``--dequantize`` / ``--quantize`` of a PyTorch DCP source: the same tensors as from the safetensors it was made of.

The safetensors path is checked bit for bit against torch's and transformers' rules (``test_lowprec``,
``test_lowprec_oracle``); here a DCP source cut in 2 or 3 data files (and a torch_dist one) must give the
same bytes through every output, since each computed tensor reads its weight and scale assembled from
their chunks (``ops.chunked.resourced``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.formats.safetensors import read_safetensors
from tests.lowprec_fixtures import bf16_model, fp8_model
from tests.trust_helpers import run_cli


def _tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of the safetensors files under ``folder``: name -> (dtype, shape, bytes)."""
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        index = read_safetensors(path)
        try:
            for name, entry in index.entries.items():
                data = np.ascontiguousarray(index.array(name)).tobytes()
                out[name] = (str(entry.dtype.st_code), tuple(entry.shape), data)
        finally:
            index.close()
    return out


def _as_safetensors(folder: Path, tmp: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = tmp / (folder.name + "_st")
    proc = run_cli("transform", str(folder), str(out), "--output-format", "safetensors")
    assert proc.returncode == 0, proc.stderr
    return _tensors(out)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_model(tmp_path_factory.mktemp("dcp-source") / "fp8")


@pytest.fixture(scope="module", params=[("dcp", 2), ("dcp", 3), ("torch_dist", 2)])
def fp8_dcp(fp8: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    fmt, ranks = request.param
    out = tmp_path_factory.mktemp("dcp-source") / f"{fmt}{ranks}"
    api.transform(str(fp8), str(out), output=api.OutputSpec(format=fmt, dcp_ranks=ranks))
    return out


@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "shape",
    [("--output-format", "safetensors"), ("--hf",)],
    ids=["one-file", "hf-shards"],
)
def test_dequantized_dcp_source_equals_the_safetensors_one(
    fp8: Path, fp8_dcp: Path, tmp_path: Path, target: str, shape: tuple[str, ...]
) -> None:
    outs = []
    for src in (fp8, fp8_dcp):
        out = tmp_path / src.name
        proc = run_cli("transform", str(src), str(out), *shape, "--dequantize", target, "--block-size", "128")
        assert proc.returncode == 0, proc.stderr
        outs.append(_tensors(out))
    assert outs[0] and outs[0] == outs[1]
    assert not any(n.endswith("_scale_inv") or n.endswith("_scales") for n in outs[1])


def test_unify_of_a_dequantized_dcp_source(fp8: Path, fp8_dcp: Path, tmp_path: Path) -> None:
    """unify's parts hold the tensors the safetensors source dequantizes to."""
    full = tmp_path / "full"
    proc = run_cli("transform", str(fp8), str(full), "--output-format", "safetensors", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "unified"
    proc = run_cli("unify", str(fp8_dcp), str(out), "--dequantize", "bf16", "--block-size", "128")
    assert proc.returncode == 0, proc.stderr
    assert (out / "param_name_map.json").is_file()
    assert _tensors(out) == _tensors(full)


@pytest.mark.parametrize("ranks", [1, 3])
def test_quantized_bf16_dcp_source_equals_the_safetensors_one(tmp_path: Path, ranks: int) -> None:
    bf16 = bf16_model(tmp_path / "bf16")
    dcp = tmp_path / "bf16_dcp"
    api.transform(str(bf16), str(dcp), output=api.OutputSpec(format="dcp", dcp_ranks=ranks))
    outs = []
    for src in (bf16, dcp):
        out = tmp_path / (src.name + "_q")
        proc = run_cli("transform", str(src), str(out), "--output-format", "safetensors", "--quantize", "fp8-block")
        assert proc.returncode == 0, proc.stderr
        outs.append(_tensors(out))
    assert outs[0] == outs[1]
    assert any(n.endswith("_scale_inv") for n in outs[1])
    # into DCP again, in whole block rows: read back as safetensors, the same pairs
    out = tmp_path / "q_dcp"
    proc = run_cli("transform", str(dcp), str(out), "--output-format", "dcp", "--quantize", "fp8-block")
    assert proc.returncode == 0, proc.stderr
    assert _as_safetensors(out, tmp_path) == outs[0]


def test_unknown_block_size_of_a_dcp_source_is_one_line(fp8_dcp: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("transform", str(fp8_dcp), str(out), "--output-format", "safetensors", "--dequantize", "bf16")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "block size unknown" in line and "--block-size" in line
    assert not out.exists()


def test_verify_dequantizes_a_dcp_side_with_the_block_given(fp8: Path, fp8_dcp: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    proc = run_cli("transform", str(fp8), str(out), "--output-format", "safetensors", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("verify", str(fp8_dcp), str(out), "--dequantize", "bf16", "--block-size", "128")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 differ" in proc.stdout
    proc = run_cli("verify", str(fp8_dcp), str(out), "--dequantize", "bf16")  # a DCP folder has no config.json
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "block size unknown" in line and "--block-size" in line
    proc = run_cli("verify", str(fp8_dcp), str(out), "--block-size", "128")
    assert proc.returncode == 2 and "give --dequantize too" in proc.stderr
