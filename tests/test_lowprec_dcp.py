"""FP8 block pairs written as PyTorch DCP and Megatron-core torch_dist (docs/low-precision.md §4).

A destination strategy cuts each scale by its weight's blocks, as for MindSpore rank folders;
``--dcp-ranks N`` (dim 0 in N parts, like ``torch.chunk``) writes a pair only when every part of the
weight's rows falls on the block grid, so each data file holds the scale blocks of exactly its rows,
and refuses any other cut in one line before any byte. torch 2.13 loads the outputs back to the stored
bytes. A DCP source dequantized or quantized: ``test_lowprec_dcp_source``.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reshard import api
from reshard.formats.dcp.metadata import read_dcp_metadata
from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.plan.quantized import Precision
from tests.lowprec_fixtures import UP, fp8_model, paired_tensors
from tests.torch_oracle import run_torch_script
from tests.trust_helpers import run_cli

SCALE = "_scale_inv"
WIDE = "model.layers.0.mlp.gate_proj.weight"  # 1024 x 384: 8 x 3 blocks
STACKED = "model.layers.0.mlp.experts.weight"  # 4 x 256 x 128: cut along the experts
SHAPES = {UP: (512, 256), WIDE: (1024, 384), STACKED: (4, 256, 128)}


def _tensors() -> dict[str, np.ndarray]:
    """On-grid pairs (every --dcp-ranks of 1, 2, 4 cuts their rows on 128), a norm, and an MXFP4 pair."""
    rng = np.random.default_rng(5)
    out = {n: v for n, v in paired_tensors().items() if "experts.gate_up" in n or n == "model.norm.weight"}
    for name, shape in SHAPES.items():
        out[name] = rng.integers(0, 0x7E, shape, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        grid = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
        out[name + SCALE] = (rng.random(grid, dtype=np.float32) * 0.01 + 1e-4).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_model(tmp_path_factory.mktemp("lowprec-dcp") / "fp8", _tensors())


def _chunks(folder: Path) -> dict[str, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each data file's chunk of each tensor: file -> name -> (offsets, sizes)."""
    out: dict[str, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for name, tensor in read_dcp_metadata(folder).tensors.items():
        for c in tensor.chunks:
            out.setdefault(c.file, {})[name] = (tuple(c.offsets), tuple(c.sizes))
    return out


def _check_pairs(folder: Path) -> int:
    """Every data file's part of each FP8 weight comes with exactly its blocks' scales; returns how many
    weights are cut."""
    cut: set[str] = set()
    for held in _chunks(folder).values():
        for name in SHAPES:
            if name not in held:
                assert name + SCALE not in held, (folder, name)
                continue
            (offsets, sizes), (s_offsets, s_sizes) = held[name], held[name + SCALE]
            blocks = [(a // 128, -(-(a + n) // 128)) for a, n in zip(offsets[-2:], sizes[-2:], strict=True)]
            assert tuple(s_offsets[:-2]) == tuple(offsets[:-2]) and tuple(s_sizes[:-2]) == tuple(sizes[:-2])
            assert [(a, a + n) for a, n in zip(s_offsets[-2:], s_sizes[-2:], strict=True)] == blocks, (folder, name)
            if tuple(sizes) != SHAPES[name]:
                cut.add(name)
    return len(cut)


def _back(folder: Path, out: Path) -> dict[str, np.ndarray]:
    api.transform(str(folder), str(out), output=api.OutputSpec(format="safetensors"))
    (part,) = out.rglob("*.safetensors")
    with read_safetensors(str(part)) as index:
        return {n: index.array(n).copy() for n in index.entries}


@pytest.mark.parametrize(("fmt", "ranks"), [("dcp", 2), ("dcp", 4), ("torch_dist", 2)])
def test_dcp_ranks_on_the_block_grid_keep_each_files_pair(model: Path, tmp_path: Path, fmt: str, ranks: int) -> None:
    out = tmp_path / "out"
    proc = run_cli("transform", str(model), str(out), "--output-format", fmt, "--dcp-ranks", str(ranks))
    assert proc.returncode == 0, proc.stderr
    assert _check_pairs(out) == len(SHAPES)
    got, want = _back(out, tmp_path / "back"), _tensors()
    assert sorted(got) == sorted(want)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_a_destination_strategy_cuts_the_scales_with_their_weights(model: Path, tmp_path: Path) -> None:
    layouts = {
        UP: ParamLayout((2, 2), (1, 0)),
        WIDE: ParamLayout((2, 2), (0, -1)),
        STACKED: ParamLayout((4,), (0, -1, -1)),
    }
    strategy = tmp_path / "s4.ckpt"
    write_strategy(strategy, make_strategy(layouts))
    for fmt in ("dcp", "torch_dist"):
        split, moved = tmp_path / f"split_{fmt}", tmp_path / f"transform_{fmt}"
        api.split(str(model), str(strategy), str(split), output=api.OutputSpec(format=fmt))
        proc = run_cli("transform", str(model), str(moved), "--dst-strategy", str(strategy), "--output-format", fmt)
        assert proc.returncode == 0, proc.stderr
        assert _check_pairs(split) == _check_pairs(moved) == len(SHAPES)
        got, want = _back(moved, tmp_path / f"back_{fmt}"), _tensors()
        assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_a_dcp_source_moves_its_pairs_to_a_strategy(model: Path, tmp_path: Path) -> None:
    """A DCP checkpoint of FP8 pairs (chunks on the block grid) to MindSpore rank folders: each rank's scale
    is its weight's blocks, as from the Hugging Face model itself."""
    dcp, ranks, direct = tmp_path / "dcp", tmp_path / "ranks", tmp_path / "direct"
    api.transform(str(model), str(dcp), output=api.OutputSpec(format="dcp", dcp_ranks=4))
    layouts = {UP: ParamLayout((2,), (-1, 0)), WIDE: ParamLayout((2,), (0, -1))}
    strategy = tmp_path / "s2.ckpt"
    write_strategy(strategy, make_strategy(layouts))
    for src, out in ((dcp, ranks), (model, direct)):  # a DCP folder has no config.json: --block-size
        args = ("--dst-strategy", str(strategy), "--output-format", "safetensors", "--block-size", "128")
        proc = run_cli("transform", str(src), str(out), *args)
        assert proc.returncode == 0, proc.stderr
    for r in (0, 1):
        (mine,), (theirs,) = (ranks / f"rank_{r}").glob("*.safetensors"), (direct / f"rank_{r}").glob("*.safetensors")
        with read_safetensors(str(mine)) as a, read_safetensors(str(theirs)) as b:
            assert sorted(a.entries) == sorted(b.entries)
            for name in (UP, UP + SCALE, WIDE, WIDE + SCALE):
                assert a.array(name).tobytes() == b.array(name).tobytes(), (r, name)


def test_a_cut_inside_a_block_moves_to_the_block_boundary(model: Path, tmp_path: Path) -> None:
    """3 parts of 512 rows of 128-row blocks: torch.chunk would cut at row 171, inside a block; the FP8
    weights are cut in whole block rows instead (2 blocks a part: rows 0-256, 256-512, the third part
    empty), so each data file holds its weight rows with the scale rows of their blocks; the plan says it."""
    out = tmp_path / "out"
    proc = run_cli("transform", str(model), str(out), "--output-format", "dcp", "--dcp-ranks", "3")
    assert proc.returncode == 0, proc.stderr
    assert _check_pairs(out) == len(SHAPES)
    meta = read_dcp_metadata(out)
    assert sorted((c.offsets, c.sizes) for c in meta.tensors[UP].chunks) == [
        ((0, 0), (256, 256)),
        ((256, 0), (256, 256)),
    ]
    assert sorted((c.offsets, c.sizes) for c in meta.tensors[UP + SCALE].chunks) == [((0, 0), (2, 2)), ((2, 0), (2, 2))]
    got, want = _back(out, tmp_path / "back"), _tensors()
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    planned = run_cli("plan", str(model), str(tmp_path / "plan"), "--output-format", "dcp", "--dcp-ranks", "3")
    assert planned.returncode == 0, planned.stderr
    done = tmp_path / "exact"
    api.transform(
        str(model),
        str(done),
        output=api.OutputSpec(format="dcp", dcp_ranks=3),
        tensors=api.TensorOptions(precision=Precision("bf16")),
    )
    assert UP + SCALE not in read_dcp_metadata(done).tensors


def test_a_cut_needs_the_block_size(tmp_path: Path) -> None:
    src = fp8_model(tmp_path / "noblock", _tensors(), block=None)
    proc = run_cli("transform", str(src), str(tmp_path / "out"), "--output-format", "dcp", "--dcp-ranks", "2")
    assert proc.returncode == 2 and "block size is unknown" in proc.stderr, proc.stderr
    proc = run_cli(
        "transform",
        str(src),
        str(tmp_path / "given"),
        "--output-format",
        "dcp",
        "--dcp-ranks",
        "2",
        "--block-size",
        "128",
    )
    assert proc.returncode == 0, proc.stderr
    assert _check_pairs(tmp_path / "given") == len(SHAPES)


def test_quantize_to_dcp_ranks_writes_pairs_on_the_grid(tmp_path: Path) -> None:
    from tests.lowprec_fixtures import bf16_model

    bf16 = bf16_model(tmp_path / "bf16")
    out = tmp_path / "q"
    proc = run_cli("transform", str(bf16), str(out), "--output-format", "dcp", "--quantize", "fp8-block")
    assert proc.returncode == 0, proc.stderr
    assert any(n.endswith(SCALE) for n in read_dcp_metadata(out).tensors)


def test_torch_loads_the_pairs_back(model: Path, tmp_path: Path) -> None:
    """torch 2.13's ``dcp.load`` of the --dcp-ranks 4 output and of the torch_dist one: the stored bytes."""
    outs = []
    for fmt, ranks in (("dcp", 4), ("torch_dist", 2)):
        out = tmp_path / fmt
        api.transform(str(model), str(out), output=api.OutputSpec(format=fmt, dcp_ranks=ranks))
        outs.append(out)
    run_torch_script("dcp_write_load.py", {"loads": [{"folder": str(o), "out": str(o) + "-whole"} for o in outs]})
    want = _tensors()
    for out in outs:
        got = np.load(str(out) + "-whole.npz")
        for name, value in want.items():
            assert got[name].tobytes() == value.tobytes(), (out, name)
