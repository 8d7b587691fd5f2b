"""FP8 block pairs resharded as pairs (docs/low-precision.md §4): each scale cut by its weight's blocks.

Real strategy files (written and read back) cut the pairs; every rank's pair is dequantized with numpy
and compared with the same box of the dequantized full weight, and merging the ranks gives the stored
bytes back. A cut off the block grid is refused before any byte is written, naming the tensor, the cut
and the block; ``--dequantize`` then cuts anywhere exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.errors import UsageError
from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout, rank_box
from reshard.plan.quantized import Precision
from tests.lowprec_fixtures import DOWN, PAIRED_SHAPES, STACKED, UP, Q, dequantized, fp8_model, paired_tensors
from tests.trust_helpers import run_cli

SCALE = "_scale_inv"
# 4 ranks, device matrix (2, 2): UP cut in rows and columns, DOWN in columns, the experts along their first axis.
FOUR = {
    UP: ParamLayout((2, 2), (1, 0)),
    DOWN: ParamLayout((2, 2), (-1, 0)),
    STACKED: ParamLayout((2, 2), (1, -1, -1)),
}
TWO = {UP: ParamLayout((2,), (-1, 0)), DOWN: ParamLayout((2,), (-1, 0)), STACKED: ParamLayout((2,), (-1, 0, -1))}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with read_safetensors(str(path)) as index:
        return {n: index.array(n).copy() for n in index.entries}


def _rank(folder: Path, r: int) -> dict[str, np.ndarray]:
    (part,) = (folder / f"rank_{r}").glob("*.safetensors")
    return _arrays(part)


def _strategy(path: Path, layouts: dict[str, ParamLayout]) -> Path:
    write_strategy(path, make_strategy(layouts))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_model(tmp_path_factory.mktemp("pairs") / "fp8", paired_tensors())


def _check_ranks(folder: Path, layouts: dict[str, ParamLayout]) -> None:
    """Every rank's pair dequantizes to its box of the dequantized full weight; its scale is the blocks' box."""
    t = paired_tensors()
    for r in range(layouts[UP].device_num):
        got = _rank(folder, r)
        for name, layout in layouts.items():
            box = rank_box(layout, PAIRED_SHAPES[name], r)
            cut = tuple(slice(a, b) for a, b in box)
            full = dequantized(t[name], t[name + SCALE])
            mine = dequantized(got[name], got[name + SCALE])
            assert np.array_equal(mine.view(np.uint32), full[cut].view(np.uint32)), (name, r)
            blocks = (*cut[:-2], *(slice(a // 128, -(-b // 128)) for a, b in box[-2:]))
            assert got[name + SCALE].tobytes() == t[name + SCALE][blocks].tobytes(), (name, r)


def test_split_cuts_each_scale_by_its_weights_blocks(model: Path, tmp_path: Path) -> None:
    strategy = _strategy(tmp_path / "s4.ckpt", FOUR)
    report = api.split(str(model), str(strategy), str(tmp_path / "ranks"))
    assert any("block scales cut with their weights" in n and "3 pair(s)" in n for n in report.notes)
    _check_ranks(tmp_path / "ranks", FOUR)


def test_transform_from_full_model_and_between_strategies(model: Path, tmp_path: Path) -> None:
    s4, s2 = _strategy(tmp_path / "s4.ckpt", FOUR), _strategy(tmp_path / "s2.ckpt", TWO)
    four, two = tmp_path / "four", tmp_path / "two"
    api.transform(str(model), str(four), None, str(s4), output=api.OutputSpec(format="safetensors"))
    _check_ranks(four, FOUR)
    api.transform(str(four), str(two), str(s4), str(s2))
    _check_ranks(two, TWO)


def test_merging_the_ranks_gives_the_stored_pairs_back(model: Path, tmp_path: Path) -> None:
    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)
    ranks, merged = tmp_path / "ranks", tmp_path / "merged"
    api.split(str(model), str(s4), str(ranks))
    api.unify(str(ranks), str(s4), str(merged))
    (part,) = merged.rglob("*.safetensors")
    got, t = _arrays(part), paired_tensors()
    for name in PAIRED_SHAPES:
        assert got[name].tobytes() == t[name].tobytes() and got[name + SCALE].tobytes() == t[name + SCALE].tobytes()


def test_dequantize_while_merging_ranks_is_exact(model: Path, tmp_path: Path) -> None:
    """Each rank's pair is on the block grid, so ranks dequantize one by one: the bytes of the full model's."""
    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)
    ranks, merged, whole = tmp_path / "ranks", tmp_path / "merged", tmp_path / "whole"
    api.split(str(model), str(s4), str(ranks))
    api.unify(str(ranks), str(s4), str(merged), tensors=api.TensorOptions(precision=Precision("bf16", (128, 128))))
    api.transform(
        str(model),
        str(whole),
        output=api.OutputSpec(format="hf"),
        tensors=api.TensorOptions(precision=Precision("bf16")),
    )
    (part,) = merged.rglob("*.safetensors")
    got, want = _arrays(part), _arrays(whole / "model.safetensors")
    for name in PAIRED_SHAPES:
        assert got[name].tobytes() == want[name].tobytes()
        assert name + SCALE not in got


def test_unify_and_split_dequantize_from_the_command_line(model: Path, tmp_path: Path) -> None:
    """``unify --dequantize`` of rank folders (no config.json beside them: ``--block-size``) and ``split
    --dequantize``: the full dequantized model's bytes."""
    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)
    ranks, merged, deq_ranks, whole = (tmp_path / n for n in ("ranks", "merged", "deq_ranks", "whole"))
    api.transform(
        str(model),
        str(whole),
        output=api.OutputSpec(format="hf"),
        tensors=api.TensorOptions(precision=Precision("bf16")),
    )
    want = _arrays(whole / "model.safetensors")
    assert run_cli("split", str(model), str(ranks), "--dst-strategy", str(s4)).returncode == 0
    proc = run_cli(
        "unify", str(ranks), str(merged), "--src-strategy", str(s4), "--dequantize", "bf16", "--block-size", "128"
    )
    assert proc.returncode == 0, proc.stderr
    (part,) = merged.rglob("*.safetensors")
    got = _arrays(part)
    assert all(got[n].tobytes() == want[n].tobytes() for n in PAIRED_SHAPES) and not any(n.endswith(SCALE) for n in got)
    proc = run_cli("split", str(model), str(deq_ranks), "--dst-strategy", str(s4), "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr
    for r in range(4):
        mine = _rank(deq_ranks, r)
        for name, layout in FOUR.items():
            cut = tuple(slice(a, b) for a, b in rank_box(layout, PAIRED_SHAPES[name], r))
            assert mine[name].tobytes() == np.ascontiguousarray(want[name][cut]).tobytes(), (name, r)


def test_checkpoint2_round_trip_keeps_the_pairs(model: Path, tmp_path: Path) -> None:
    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)
    cp2, back = tmp_path / "cp2", tmp_path / "back"
    api.transform(str(model), str(cp2), None, str(s4), output=api.OutputSpec(format="checkpoint2"))
    api.transform(str(cp2), str(back), output=api.OutputSpec(format="safetensors"))
    (part,) = back.rglob("*.safetensors")
    got, t = _arrays(part), paired_tensors()
    for name in PAIRED_SHAPES:
        assert got[name].tobytes() == t[name].tobytes() and got[name + SCALE].tobytes() == t[name + SCALE].tobytes()


def test_a_cut_off_the_block_grid_is_refused_before_any_byte(model: Path, tmp_path: Path) -> None:
    """Q is 300 rows: two ranks cut it at row 150, inside a 128-row block."""
    strategy = _strategy(tmp_path / "bad.ckpt", {Q: ParamLayout((2,), (0, -1))})
    for command in ("split", "plan"):
        out = tmp_path / command
        if command == "split":
            args = ["split", str(model), str(out), "--strategy", str(strategy)]
        else:
            args = ["plan", "--src", str(model), "--dst", str(out), "--dst-strategy", str(strategy)]
        proc = run_cli(*args)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert Q in line and "row 150" in line and "128x128" in line and "--dequantize" in line, proc.stderr
        assert not out.exists()
    done = tmp_path / "exact"
    api.split(
        str(model), str(strategy), str(done), tensors=api.TensorOptions(precision=Precision("bf16"))
    )  # exact at any cut
    assert Q + SCALE not in _rank(done, 1)


def test_a_cut_needs_the_block_size(tmp_path: Path) -> None:
    src = fp8_model(tmp_path / "noblock", paired_tensors(), block=None)
    strategy = _strategy(tmp_path / "s2.ckpt", TWO)
    with pytest.raises(UsageError, match="block size is unknown"):
        api.split(str(src), str(strategy), str(tmp_path / "out"))
    api.split(
        str(src),
        str(strategy),
        str(tmp_path / "given"),
        tensors=api.TensorOptions(precision=Precision(block_size=(128, 128))),
    )
    _check_ranks(tmp_path / "given", TWO)


def test_a_scale_laid_out_apart_from_its_weight_is_refused(model: Path, tmp_path: Path) -> None:
    layouts = {**TWO, UP + SCALE: ParamLayout((2,), (0, -1))}
    strategy = _strategy(tmp_path / "apart.ckpt", layouts)
    with pytest.raises(UsageError, match="apart from its weight"):
        api.split(str(model), str(strategy), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_mxfp4_scales_follow_their_blocks(model: Path, tmp_path: Path) -> None:
    """MXFP4 blocks [experts, rows, groups, 16] cut by experts and groups: each rank's scales are its groups'."""
    from tests.lowprec_fixtures import EXPERTS

    blocks, scales = EXPERTS + "_blocks", EXPERTS + "_scales"
    layout = ParamLayout((2, 3), (1, -1, 0, -1))  # experts in 2, the 3 groups in 3
    api.split(str(model), str(_strategy(tmp_path / "s6.ckpt", {blocks: layout})), str(tmp_path / "ranks"))
    t = paired_tensors()
    for r in range(6):
        got = _rank(tmp_path / "ranks", r)
        box = rank_box(layout, t[blocks].shape, r)
        cut = tuple(slice(a, b) for a, b in box)
        assert (
            got[blocks].tobytes() == t[blocks][cut].tobytes() and got[scales].tobytes() == t[scales][cut[:-1]].tobytes()
        )
    inside = _strategy(tmp_path / "inside.ckpt", {blocks: ParamLayout((2,), (-1, -1, -1, 0))})
    with pytest.raises(UsageError, match="16 bytes of an MXFP4 block"):
        api.split(str(model), str(inside), str(tmp_path / "out"))


def test_plan_json_lists_the_scales_beside_their_weights(model: Path, tmp_path: Path) -> None:
    strategy = _strategy(tmp_path / "s4.ckpt", FOUR)
    proc = run_cli("plan", "--src", str(model), "--dst", str(tmp_path / "o"), "--dst-strategy", str(strategy), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = {t["name"]: t["shape"] for f in doc["files"] if "rank_0" in f["path"] for t in f["tensors"]}
    assert names[UP] == [256, 128] and names[UP + SCALE] == [2, 1]


# ------------------------------------------------------------------------------------------ inspect


def test_inspect_shows_quantized_weights_and_counts_each_pair_once(tmp_path: Path) -> None:
    from reshard.inspection import gather
    from tests.lowprec_fixtures import EXPERTS, NORM, K, fp8_tensors

    src = fp8_model(tmp_path / "fp8", fp8_tensors())
    info = gather(str(src))
    q = info["quantized"]
    assert q[Q] == {"format": "fp8-block", "block": [128, 128], "scale": Q + SCALE, "values": 300 * 260}
    assert q[K + SCALE] == {"scale_of": K} and q[EXPERTS + "_scales"] == {"scale_of": EXPERTS + "_blocks"}
    assert q[EXPERTS + "_blocks"]["values"] == 2 * 6 * 3 * 32 and NORM not in q
    summary = info["summary"]
    assert summary["parameters"] == 4 and "quantized" not in summary  # the view is info["quantized"]
    assert summary["parameter_elements"] == 300 * 260 + 130 * 256 + 64 + 2 * 96 * 6
    proc = run_cli("inspect", str(src), "--params")
    assert proc.returncode == 0, proc.stderr
    assert "quantized: 2 FP8 block weight(s) (128x128 blocks" in proc.stdout and "each pair counted once" in proc.stdout
    assert "Float8E4M3FN (fp8-block, 128x128 blocks)" in proc.stdout and "(block scale)" in proc.stdout
    unknown = fp8_model(tmp_path / "noblock", fp8_tensors(), block=None)
    assert gather(str(unknown))["quantized"][Q]["block"] is None


def test_inspect_rank_folders_with_their_strategy(model: Path, tmp_path: Path) -> None:
    from reshard.inspection import gather

    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)
    api.split(str(model), str(s4), str(tmp_path / "ranks"))
    info = gather(str(tmp_path / "ranks"), str(s4))
    assert {n for n, q in info["quantized"].items() if "format" in q} == set(PAIRED_SHAPES)
    assert info["summary"]["parameters"] == 3
    assert info["summary"]["parameter_elements"] == sum(int(np.prod(s)) for s in PAIRED_SHAPES.values())
