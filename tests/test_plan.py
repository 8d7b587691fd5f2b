"""Planner and executor without MindSpore: round trips through layouts MindSpore cannot do,
plans as plain data, and the executor's copy paths (byte runs, strided boxes, chunked outputs)."""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard import api, layout
from reshard.errors import ReshardError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats.ckpt import SLICE_BYTES, read_ckpt, save_ckpt
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L

RNG = np.random.default_rng(7)
FULL = {
    "w": RNG.standard_normal((12, 6)).astype(np.float32),
    "h": RNG.standard_normal((6, 12)).astype(np.float16),
    "v": RNG.standard_normal(12).astype(ml_dtypes.bfloat16),
    "i": RNG.integers(0, 100, (12, 12)).astype(np.int64),
    "global_step": np.array([3], np.int32),
}


def _strategy(tmp, name: str, layouts: dict[str, L]) -> str:
    path = os.path.join(tmp, f"{name}.ckpt")
    write_strategy(path, make_strategy(layouts))
    return path


def _check_rank_files(folder: str, strategy: dict[str, L], prefix: str = "checkpoint_") -> None:
    n = next(iter(strategy.values())).device_num
    for rank in range(n):
        with read_ckpt(os.path.join(folder, f"rank_{rank}", f"{prefix}{rank}.ckpt")) as index:
            for name, arr in FULL.items():
                want = arr
                if name in strategy:
                    box = layout.rank_box(strategy[name], arr.shape, rank)
                    want = arr[tuple(slice(a, b) for a, b in box)]
                assert np.array_equal(index.array(name), want), (rank, name)


FOUR = {"w": L((2, 2), (1, 0)), "h": L((2, 2), (-1, 1)), "v": L((2, 2), (0,)), "i": L((2, 2), (0, -1), 2, 2)}
SIX_A = {"w": L((3, 2), (1, 0)), "h": L((3, 2), (0, 1)), "v": L((3, 2), (1,)), "i": L((3, 2), (-1, 1))}
SIX_B = {"w": L((2, 3), (0, -1)), "h": L((2, 3), (-1, 0)), "v": L((2, 3), (0,)), "i": L((2, 3), (1, 0))}
EIGHT = {
    "w": L((2, 2, 2), (2, 0)),
    "h": L((2, 2, 2), (-1, 1)),
    "v": L((2, 2, 2), (2,)),
    "i": L((2, 2, 2), (0, 1), 4, 2),
}


@pytest.mark.parametrize(
    ("src", "dst"), [(FOUR, SIX_A), (EIGHT, SIX_B), (SIX_A, FOUR), (SIX_B, EIGHT)], ids=["4->6", "8->6", "6->4", "6->8"]
)
def test_device_counts_that_do_not_divide(tmp_path, src: dict[str, L], dst: dict[str, L]) -> None:
    """Beyond MindSpore (it refuses): 4 -> 6, 8 -> 6 and back give the exact slices."""
    tmp = str(tmp_path)
    full = os.path.join(tmp, "full", "m.ckpt")
    save_ckpt(full, FULL)
    s_src, s_dst = _strategy(tmp, "src", src), _strategy(tmp, "dst", dst)
    api.transform(full, f"{tmp}/a", None, s_src)
    api.transform(f"{tmp}/a", f"{tmp}/b", s_src, s_dst)
    _check_rank_files(f"{tmp}/b", dst)
    api.transform(f"{tmp}/b", f"{tmp}/c", s_dst, None)
    with read_ckpt(f"{tmp}/c/rank_0/checkpoint_0.ckpt") as index:
        for name, arr in FULL.items():
            assert np.array_equal(index.array(name), arr)


def test_by_rank_reads_only_needed_files(tmp_path) -> None:
    tmp = str(tmp_path)
    full = os.path.join(tmp, "full", "m.ckpt")
    save_ckpt(full, {"w": FULL["w"], "global_step": FULL["global_step"]})
    s4, s6 = _strategy(tmp, "four", {"w": L((4,), (0, -1))}), _strategy(tmp, "six", {"w": L((6,), (0, -1))})
    api.transform(full, f"{tmp}/a", None, s4)
    report = api.transform(f"{tmp}/a", f"{tmp}/b", s4, s6, ranks=[5])
    assert [f.rank for f in report.plan.files] == [5]
    assert report.plan.sources == (os.path.join(tmp, "a", "rank_3", "checkpoint_3.ckpt"),)  # rows 10-11 only
    with read_ckpt(f"{tmp}/b/rank_5/checkpoint_5.ckpt") as index:
        assert np.array_equal(index.array("w"), FULL["w"][10:12])


def test_plan_is_plain_data_and_dry_run_writes_nothing(tmp_path) -> None:
    tmp = str(tmp_path)
    full = os.path.join(tmp, "full", "m.ckpt")
    save_ckpt(full, FULL)
    s4 = _strategy(tmp, "four", FOUR)
    report = api.transform(full, f"{tmp}/out", None, s4, destination=api.Destination(dry_run=True))
    assert not os.path.exists(f"{tmp}/out")
    data = json.loads(json.dumps(report.plan.to_json()))
    assert data["outputs"] == 4 and data["bytes_written"] == report.plan.bytes_written
    assert report.plan.largest_tensor == FULL["i"].nbytes // 4  # "i": rows split over 2 ranks, opt shard 2


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("chunk", [SLICE_BYTES, 100])
def test_executor_paths_give_identical_files(tmp_path, workers: int, chunk: int) -> None:
    """Byte runs, strided boxes and chunked .ckpt outputs (staged row blocks) agree."""
    tmp = str(tmp_path)
    full = os.path.join(tmp, "full", "m.ckpt")
    save_ckpt(full, FULL)
    s8 = _strategy(tmp, "eight", EIGHT)
    api.transform(full, f"{tmp}/a", None, s8)
    run, write = RunOptions(workers=workers, max_memory=256), WriteOptions(chunk_bytes=chunk)
    api.transform(f"{tmp}/a", f"{tmp}/full2", s8, None, write=write, run=run)
    with read_ckpt(f"{tmp}/full2/rank_0/checkpoint_0.ckpt") as index:
        for name, arr in FULL.items():
            assert np.array_equal(index.array(name), arr)


def test_convert_keeps_strings_through_safetensors(tmp_path) -> None:
    """MindSpore cannot convert a .ckpt holding strings; we keep them in the safetensors metadata."""
    from reshard.formats.safetensors import read_safetensors

    src = tmp_path / "ck" / "rank_0" / "m.ckpt"
    save_ckpt(str(src), {"w": FULL["w"], "note": "héllo", "empty": "", "global_step": FULL["global_step"]})
    api.convert(str(tmp_path / "ck"), str(tmp_path / "st"), "safetensors")
    with read_safetensors(str(tmp_path / "st" / "rank_0" / "m.safetensors")) as index:
        assert set(index) == {"w", "global_step"}
        assert index.metadata["reshard.str:note"] == "héllo"
    api.convert(str(tmp_path / "st"), str(tmp_path / "back"), "ckpt")
    with read_ckpt(str(tmp_path / "back" / "rank_0" / "m.ckpt")) as index:
        assert index.value("note") == "héllo" and index.value("empty") == ""
        assert list(index) == ["empty", "global_step", "note", "w"]  # sorted, as safetensors_to_ckpt writes
        assert np.array_equal(index.array("w"), FULL["w"])


DEVS = [(2,), (4,), (2, 2), (2, 3), (3, 2), (2, 2, 2), (1, 2), (2, 1, 2), (4, 2)]


@st.composite
def param_layouts(draw: st.DrawFn, ndim: int) -> L:
    """A random valid layout: flat or list tensor map, maybe an optimizer shard."""
    dev = draw(st.sampled_from(DEVS))
    axes = list(range(len(dev)))
    draw(st.randoms()).shuffle(axes)
    tmap: list[object] = []
    for _ in range(ndim):
        k = draw(st.integers(0, min(2, len(axes))))
        values, axes = tuple(axes[:k]), axes[k:]
        tmap.append(-1 if not values else values[0] if len(values) == 1 or not draw(st.booleans()) else values)
        if isinstance(tmap[-1], int) and len(values) > 1:
            axes = list(values[1:]) + axes
    step, size = 0, 0
    if draw(st.booleans()):
        size = draw(st.sampled_from([2, -1]))
        step = draw(st.sampled_from([1, 2, 3, 4]))
    return L(dev, tuple(tmap), step, size)  # type: ignore[arg-type]


def _valid(p: L, shape: tuple[int, ...]) -> bool:
    try:
        layout.rank_box(p, shape, 0)
    except ReshardError:
        return False
    return True


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_layout_chains_round_trip(tmp_path_factory, data: st.DataObject) -> None:
    """full -> A -> B -> full through real files gives back every tensor, for random layouts."""
    shape = data.draw(st.sampled_from([(24, 12), (12, 24), (48, 24)]))
    a, b = data.draw(param_layouts(2)), data.draw(param_layouts(2))
    assume(_valid(a, shape) and _valid(b, shape))
    tmp = str(tmp_path_factory.mktemp("chain"))
    arr = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    save_ckpt(f"{tmp}/full/m.ckpt", {"w": arr, "global_step": FULL["global_step"]})
    sa, sb = _strategy(tmp, "a", {"w": a}), _strategy(tmp, "b", {"w": b})
    api.transform(f"{tmp}/full/m.ckpt", f"{tmp}/A", None, sa)
    api.transform(f"{tmp}/A", f"{tmp}/B", sa, sb)
    for rank in range(b.device_num):
        with read_ckpt(f"{tmp}/B/rank_{rank}/checkpoint_{rank}.ckpt") as index:
            box = layout.rank_box(b, shape, rank)
            assert np.array_equal(index.array("w"), arr[tuple(slice(x, y) for x, y in box)])
    api.transform(f"{tmp}/B", f"{tmp}/F", sb, None)
    with read_ckpt(f"{tmp}/F/rank_0/checkpoint_0.ckpt") as index:
        assert np.array_equal(index.array("w"), arr)
