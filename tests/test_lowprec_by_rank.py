"""FP8 block pairs through ``transform_by_rank`` (docs/low-precision.md §4): one destination rank's file
slices each scale by its weight's blocks, exactly as the whole transform does.

Each destination rank is written alone, from the source ranks ``needed_ranks`` names, through the API,
the MindSpore drop-in (``.ckpt``) and the CLI's MindFormers tool; its bytes equal that rank's file of the
whole transform. A destination cut off the block grid is refused in one line before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard import mindspore as ms
from reshard.errors import UsageError
from reshard.formats.ckpt import read_ckpt
from reshard.formats.safetensors import read_safetensors
from reshard.layout import ParamLayout
from tests.lowprec_fixtures import fp8_model, paired_tensors
from tests.test_lowprec_pairs import FOUR, TWO, Q, _strategy
from tests.trust_helpers import run_cli


def _arrays(path: Path) -> dict[str, bytes]:
    reader = read_safetensors if path.suffix == ".safetensors" else read_ckpt
    with reader(str(path)) as index:
        return {n: np.ascontiguousarray(index.array(n)).tobytes() for n in index.entries}


def _one(folder: Path, r: int) -> Path:
    (part,) = (p for p in (folder / f"rank_{r}").iterdir() if p.suffix in (".safetensors", ".ckpt"))
    return part


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The paired model on 4 ranks (.safetensors and .ckpt), and its strategy."""
    tmp = tmp_path_factory.mktemp("by_rank")
    model = fp8_model(tmp / "fp8", paired_tensors())
    s4 = _strategy(tmp / "s4.ckpt", FOUR)
    for fmt in ("safetensors", "ckpt"):
        api.transform(str(model), str(tmp / fmt), None, str(s4), output=api.OutputSpec(format=fmt))
    return tmp, s4, model


@pytest.mark.parametrize("fmt", ["safetensors", "ckpt"])
def test_each_rank_alone_equals_the_whole_transform(four: tuple[Path, Path, Path], tmp_path: Path, fmt: str) -> None:
    tmp, s4, _ = four
    s2 = _strategy(tmp_path / "s2.ckpt", TWO)
    whole = tmp_path / "whole"
    api.transform(str(tmp / fmt), str(whole), str(s4), str(s2))
    for r in range(2):
        files = {s: str(_one(tmp / fmt, s)) for s in api.needed_ranks(r, str(s4), str(s2))}
        out = tmp_path / f"alone_{r}" / f"checkpoint_{r}.{fmt}"
        if fmt == "ckpt":  # the MindSpore drop-in writes .ckpt
            ms.transform_checkpoint_by_rank(r, files, str(out), str(s4), str(s2))
        else:
            api.transform_by_rank(r, files, str(out), str(s4), str(s2))
        got, want = _arrays(out), _arrays(_one(whole, r))
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == want[name], (r, name)


def test_the_mindformers_tool_by_rank_cuts_the_scales(four: tuple[Path, Path, Path], tmp_path: Path) -> None:
    tmp, s4, _ = four
    s2 = _strategy(tmp_path / "s2.ckpt", TWO)
    whole, alone = tmp_path / "whole", tmp_path / "alone"
    api.transform(str(tmp / "ckpt"), str(whole), str(s4), str(s2))
    args = ["--src_checkpoint", str(tmp / "ckpt"), "--src_strategy", str(s4), "--dst_strategy", str(s2)]
    proc = run_cli(
        "transform", *args, "--dst_checkpoint", str(alone), "--world_size", "2", "--transform_by_rank", "True"
    )
    assert proc.returncode == 0, proc.stderr
    for r in range(2):
        assert _arrays(_one(alone / "ckpt", r)) == _arrays(_one(whole, r))  # the tool adds the source folder's name


def test_a_cut_off_the_block_grid_is_refused_in_one_line(four: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Q is 300 rows: the destination cuts it at row 150, inside a 128-row block."""
    _, _, model = four
    bad = _strategy(tmp_path / "bad.ckpt", {Q: ParamLayout((2,), (0, -1))})
    out = tmp_path / "out" / "checkpoint_0.safetensors"
    with pytest.raises(UsageError, match="row 150") as caught:
        api.transform_by_rank(0, {0: str(model / "model.safetensors")}, str(out), None, str(bad))
    assert Q in str(caught.value) and "128x128" in str(caught.value) and "\n" not in str(caught.value)
    assert not out.parent.exists()
