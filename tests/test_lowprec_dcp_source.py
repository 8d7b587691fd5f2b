"""``--dequantize`` / ``--quantize`` of a PyTorch DCP source: the same tensors as from the safetensors it was made of.

The safetensors path is checked bit for bit against torch's and transformers' rules (``test_lowprec``,
``test_lowprec_oracle``); here a DCP source cut in 2 or 3 data files (and a torch_dist one) must give the
same bytes through every output, since each computed tensor reads its weight and scale assembled from
their chunks (``ops.chunked.resourced``). A DCP folder reshard writes from FP8 pairs carries a config.json
saying their block size, so reading it back needs no ``--block-size``; one torch wrote (none) does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.formats.safetensors import read_safetensors
from reshard.plan.output_config import quantization_config
from reshard.plan.quantized_dcp import config_for_dcp
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


def _without_config(folder: Path, tmp: Path) -> Path:
    """A copy of a DCP folder without the config.json reshard writes beside it: what torch's own save leaves."""
    copy = tmp / f"{folder.name}-torch-like"
    shutil.copytree(folder, copy)
    (copy / "config.json").unlink()
    return copy


def test_a_dcp_output_of_fp8_pairs_carries_its_block_size(fp8: Path, fp8_dcp: Path, tmp_path: Path) -> None:
    """The source's config.json goes beside .metadata (listed in the manifest), so reading the DCP back needs
    no --block-size: dequantized, it equals the safetensors source's output."""
    config = json.loads((fp8_dcp / "config.json").read_text())
    assert config["model_type"] == "tiny"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    manifest = json.loads((fp8_dcp / "reshard-manifest.json").read_text())
    assert "config.json" in [o["path"] for o in manifest["outputs"]]
    outs = []
    for src in (fp8, fp8_dcp):
        out = tmp_path / f"{src.name}-bf16"
        proc = run_cli("transform", str(src), str(out), "--output-format", "safetensors", "--dequantize", "bf16")
        assert proc.returncode == 0, proc.stderr
        outs.append(_tensors(out))
    assert outs[0] and outs[0] == outs[1]


def test_quantizing_into_dcp_writes_the_block_it_used(tmp_path: Path) -> None:
    bf16 = bf16_model(tmp_path / "bf16")
    (bf16 / "config.json").unlink()  # no config to copy: the DCP's says the quantization alone
    dcp = tmp_path / "dcp"
    proc = run_cli(
        "transform",
        str(bf16),
        str(dcp),
        "--output-format",
        "torch_dist",
        "--quantize",
        "fp8-block",
        "--block-size",
        "64",
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads((dcp / "config.json").read_text())
    assert config == {"quantization_config": quantization_config((64, 64))}
    back = tmp_path / "back"
    proc = run_cli("transform", str(dcp), str(back), "--output-format", "safetensors", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr


def test_fp8_pairs_of_an_unknown_block_written_as_dcp_say_so(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    proc = run_cli("transform", str(fp8_model(tmp_path / "m", block=None)), str(out), "--output-format", "dcp")
    assert proc.returncode == 0, proc.stderr
    assert "reading it back with --dequantize will need --block-size" in proc.stderr
    assert not (out / "config.json").exists()
    given = tmp_path / "given"
    proc = run_cli("transform", str(tmp_path / "m"), str(given), "--output-format", "dcp", "--block-size", "128")
    assert proc.returncode == 0, proc.stderr
    quant = json.loads((given / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [128, 128] and quant["fmt"] == "e4m3"  # the source's keys kept


def test_config_for_dcp() -> None:
    source = {"model_type": "m", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert config_for_dcp((128, 128), source, requantized=False) == source
    assert config_for_dcp((None, 128), source, requantized=False) is None
    assert config_for_dcp(None, None, requantized=True) is None
    assert config_for_dcp((64, 32), source, requantized=True) == {
        "model_type": "m",
        "quantization_config": quantization_config((64, 32)),
    }
    assert config_for_dcp((128, 128), None, requantized=False) == {
        "quantization_config": quantization_config((128, 128))
    }


def test_unknown_block_size_of_a_dcp_source_is_one_line(fp8_dcp: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    src = _without_config(fp8_dcp, tmp_path)
    proc = run_cli("transform", str(src), str(out), "--output-format", "safetensors", "--dequantize", "bf16")
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
    proc = run_cli("verify", str(fp8_dcp), str(out), "--dequantize", "bf16")  # the block from its config.json
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 differ" in proc.stdout
    torch_like = _without_config(fp8_dcp, tmp_path)  # a DCP torch saved has no config.json
    proc = run_cli("verify", str(torch_like), str(out), "--dequantize", "bf16")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "block size unknown" in line and "--block-size" in line
    proc = run_cli("verify", str(fp8_dcp), str(out), "--block-size", "128")
    assert proc.returncode == 2 and "give --dequantize too" in proc.stderr


def test_a_megatron_run_folder_finds_the_config_of_its_checkpoint(fp8: Path, tmp_path: Path) -> None:
    """A torch_dist output in a run folder (``--dst-iteration``) keeps config.json in ``iter_*``; reading the run
    folder finds it there (``inspect`` shows the block, ``--dequantize`` needs no ``--block-size``)."""
    run = tmp_path / "run"
    proc = run_cli("transform", str(fp8), str(run), "--output-format", "torch_dist", "--dst-iteration", "100")
    assert proc.returncode == 0, proc.stderr
    assert (run / "iter_0000100" / "config.json").is_file()
    proc = run_cli("inspect", str(run))
    assert proc.returncode == 0 and "128x128 blocks" in proc.stdout, proc.stdout + proc.stderr
    out = tmp_path / "bf16"
    proc = run_cli("transform", str(run), str(out), "--output-format", "safetensors", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr


def test_overwrite_supersedes_the_config_reshard_wrote_not_a_users(fp8: Path, tmp_path: Path) -> None:
    """An --overwrite that writes no FP8 pairs removes the config.json of the FP8 checkpoint it replaces (its
    block size would describe pairs that are gone), but never one the user put there."""
    out = tmp_path / "dcp"
    assert run_cli("transform", str(fp8), str(out), "--output-format", "dcp").returncode == 0
    assert (out / "config.json").is_file()
    bf16 = bf16_model(tmp_path / "bf16")
    proc = run_cli("transform", str(bf16), str(out), "--output-format", "dcp", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "config.json").exists()
    (out / "config.json").write_text('{"mine": 1}')
    proc = run_cli("transform", str(bf16), str(out), "--output-format", "dcp", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text()) == {"mine": 1}
