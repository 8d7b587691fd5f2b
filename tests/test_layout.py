"""Layout engine: spec vectors (8.2), error cases, and property tests against a naive reference.

The naive reference materialises ``arange(prod(shape)).reshape(shape)``, cuts it with np.split
along every split dim of the flat layout and reshapes to the final slice shape (docs/formats.md §3.1-§3.3 read
literally); boxes, coverage and transfer pieces are checked against it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import LayoutError, UnsupportedError
from reshard.layout import (
    FlatLayout,
    ParamLayout,
    StagedLayout,
    flat_layout,
    flat_rank_box,
    full_shape,
    needed_ranks,
    normalize_device_num,
    opt_shard_size,
    rank_box,
    rank_list_for_transform,
    redundancy_groups,
    slice_shape,
    tensor_strategy,
    transfer_pieces,
    transfer_table,
)

P = ParamLayout

# --------------------------------------------------------------------------------------------
# random layouts (shared with test_layout_oracle.py): written against random.Random's API so that
# hypothesis (st.randoms) and seeded oracle batches use the same generator.

DEV_DIMS = (1, 2, 2, 3, 4)
MAX_DEVICES = 48


def _suffix(dims: tuple[int, ...], j: int) -> int:
    return math.prod(dims[j + 1 :])


def random_dev(rng: random.Random, devices: int) -> list[int]:
    """A random ordered factorisation of ``devices`` into at most 4 dims (size-1 dims included)."""
    dims: list[int] = []
    rest = devices
    while rest > 1 and len(dims) < 3:
        d = rng.choice([d for d in range(2, rest + 1) if rest % d == 0])
        dims.append(d)
        rest //= d
    dims.append(rest)
    if len(dims) < 4 and rng.random() < 0.25:
        dims.insert(rng.randrange(len(dims) + 1), 1)
    rng.shuffle(dims)
    return dims


def random_layout(
    rng: random.Random,
    ndim: int | None = None,
    list_map: bool | None = None,
    opt: bool | None = None,
    devices: int | None = None,
) -> ParamLayout:
    """A valid random layout: flat or list map, optionally optimizer-sharded (simple or helper path)."""
    if devices is None:
        n = rng.randint(1, 4)
        dev = [rng.choice(DEV_DIMS) for _ in range(n)]
        while math.prod(dev) > MAX_DEVICES:
            dev[rng.randrange(n)] = 1
    else:
        dev = random_dev(rng, devices)
        n = len(dev)
    ndim = rng.randint(1, 3) if ndim is None else ndim
    list_map = rng.random() < 0.3 if list_map is None else list_map
    opt = rng.random() < 0.5 if opt is None else opt
    dp_style = opt and rng.random() < 0.4  # all dims but the outermost used: the simple path
    entries: list[list[int]] = [[] for _ in range(ndim)]
    for j in rng.sample(range(n), n):
        if ndim == 0 or (j == 0 and dp_style):
            continue
        if dp_style or rng.random() < 0.5:
            free = [t for t in range(ndim) if list_map or not entries[t]]
            if free:
                entries[rng.choice(free)].append(n - 1 - j)
    if list_map:
        tmap: tuple = tuple(tuple(e) if e else (-1,) for e in entries)
    else:
        tmap = tuple(e[0] if e else -1 for e in entries)
    layout = P(tuple(dev), tmap)
    if not (opt and ndim):
        return layout
    used = {n - 1 - v for e in entries for v in e}
    rep = [j for j in range(n) if j not in used and dev[j] > 1]
    if not rep:
        return layout
    total = math.prod(dev[j] for j in rep)
    if len(rep) == 1:
        step = _suffix(tuple(dev), rep[0])
    elif len(rep) == n:
        step = 1  # simple path on an all-repeat device matrix: groups of consecutive ranks
    else:
        step = _suffix(tuple(dev), rep[-1])  # helper path: MindSpore ignores the step
    sizes = [d for d in range(2, total + 1) if total % d == 0]
    rng.shuffle(sizes)
    for size in [-1, *sizes] if rng.random() < 0.3 else [*sizes, -1]:
        candidate = P(tuple(dev), tmap, step, size)
        try:  # not every divisor fits the helper path's walk over the repeat dims
            flat_layout(candidate, full_shape(candidate, [1] * ndim))
        except LayoutError:
            continue
        return candidate
    return layout


def random_full(rng: random.Random, p: ParamLayout) -> tuple[int, ...]:
    return full_shape(p, [rng.randint(1, 3) for _ in p.tensor_map])


def parts(p: ParamLayout) -> list[int]:
    """Number of slices along every full dim (final slice = full / parts)."""
    out = list(tensor_strategy(p))
    if out:
        out[0] *= max(opt_shard_size(p), 1)
    return out


def random_pair(rng: random.Random) -> tuple[ParamLayout | None, ParamLayout | None, tuple[int, ...]]:
    """Two layouts of one tensor (either may be None = the full tensor) and a shape both divide."""
    ndim = rng.randint(1, 3)
    src = random_layout(rng, ndim) if rng.random() < 0.85 else None
    dst = random_layout(rng, ndim) if rng.random() < 0.85 else None
    a = parts(src) if src else [1] * ndim
    b = parts(dst) if dst else [1] * ndim
    return src, dst, tuple(math.lcm(x, y) * rng.randint(1, 2) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------
# the naive reference


def coords(dev: tuple[int, ...], rank: int) -> list[int]:
    return [(rank // _suffix(dev, j)) % dev[j] for j in range(len(dev))]


def naive_slice(p: ParamLayout | None, full: np.ndarray, rank: int) -> np.ndarray:
    """The data rank holds: chunk the flat-layout view with np.split, then reshape (docs/formats.md §3.3 step 6)."""
    if p is None:
        return full
    flat = flat_layout(p, full.shape)
    x = full.reshape(flat.shape)
    c = coords(flat.dev, rank)
    n = len(flat.dev)
    for axis, v in enumerate(flat.tmap):
        if v != -1:
            x = np.split(x, flat.dev[n - 1 - v], axis=axis)[c[n - 1 - v]]
    return x.reshape(slice_shape(p, full.shape))


def cut(full: np.ndarray, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def arange(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(math.prod(shape)).reshape(shape)


# --------------------------------------------------------------------------------------------
# tiny local layout map (docs/formats.md §2.4): {"<stage>-name" or name: ParamLayout} -> {name: StagedLayout}


def layout_map(items: Mapping[str, ParamLayout], rank_id: int | None = None) -> dict[str, StagedLayout]:
    layouts: dict[str, ParamLayout] = {}
    stages: dict[str, list[int]] = {}
    for key, layout in items.items():
        stage, name = (int(key.split("-")[0]), key.split("-")[1]) if "-" in key else (0, key)
        if name not in layouts:
            layouts[name], stages[name] = layout, [stage]
            continue
        stages[name].append(stage)
        if rank_id is None:
            if stage <= min(stages[name]):
                layouts[name] = layout
        else:
            group = rank_id // layout.device_num
            if (group == 0 and stage == 0) or (group > 0 and stage > 0):
                layouts[name] = layout
    return {k: StagedLayout(layouts[k], tuple(stages[k])) for k in layouts}


def ms_rank_list(rank: int, src: Mapping[str, ParamLayout] | None, dst: Mapping[str, ParamLayout] | None) -> list[int]:
    """rank_list_for_transform with strategy-file-like inputs (device numbers from the maps)."""
    return rank_list_for_transform(
        rank, layout_map(src) if src is not None else None, layout_map(dst, rank) if dst is not None else None
    )


# --------------------------------------------------------------------------------------------
# docs/formats.md §8.2 vectors

W84 = (8, 4)


def rows(lo: int, hi: int, cols: int = 4) -> tuple[tuple[int, int], ...]:
    return ((lo, hi), (0, cols))


def test_l1_rows() -> None:
    p = P((2, 2), (1, -1))
    assert [rank_box(p, W84, r) for r in range(4)] == [rows(0, 4), rows(0, 4), rows(4, 8), rows(4, 8)]
    full = arange(W84)
    pieces = transfer_pieces(None, p, W84, 3)
    assert pieces == [(0, rows(4, 8))]
    assert np.array_equal(cut(full, pieces[0][1]), full[4:8])


def test_l2_columns_and_rank_lists() -> None:
    src = {"w": P((2, 2), (1, -1)), "b": P((2, 2), (-1,))}
    dst = {"w": P((4,), (-1, 0)), "b": P((4,), (0,))}
    assert [rank_box(dst["w"], W84, r) for r in range(4)] == [((0, 8), (r, r + 1)) for r in range(4)]
    assert [ms_rank_list(r, src, dst) for r in range(4)] == [[2, 0], [3, 1], [2, 0], [3, 1]]
    assert transfer_pieces(src["w"], dst["w"], W84, 1) == [(1, ((0, 4), (1, 2))), (3, ((4, 8), (1, 2)))]
    assert transfer_pieces(src["b"], dst["b"], (4,), 2) == [(2, ((2, 3),))]


def test_l3_l4_opt_shard_quirk() -> None:
    plain = P((2, 2, 2), (0, 1))
    assert rank_box(plain, (8, 8), 1) == ((4, 8), (0, 4))
    opt = P((2, 2, 2), (0, 1), opt_shard_step=4, opt_shard_size=2)
    assert flat_layout(opt, (8, 8)) == FlatLayout((2, 2, 2), (1, 2, 0), (2, 4, 8))
    assert rank_box(opt, (8, 8), 1) == ((0, 2), (4, 8))
    assert rank_box(opt, (8, 8), 4) == ((2, 4), (0, 4))
    # identical to tensor map [1, 0] with the same optimizer shard
    swapped = P((2, 2, 2), (1, 0), opt_shard_step=4, opt_shard_size=2)
    assert all(rank_box(opt, (8, 8), r) == rank_box(swapped, (8, 8), r) for r in range(8))
    assert slice_shape(opt, (8, 8)) == (2, 4)
    assert full_shape(opt, (2, 4)) == (8, 8)


def test_l5_rank_list_with_device_count_change() -> None:
    src = {"w": P((2, 2), (1, -1)), "b": P((2, 2), (0,))}
    dst = {"w": P((2,), (-1, 0)), "b": P((2,), (-1,))}
    assert ms_rank_list(1, src, dst) == [3, 1, 0]


def test_l6_l7_needed_ranks() -> None:
    f, t = FlatLayout((4, 2), (1, 0), (8, 8)), FlatLayout((2, 4), (1, 0), (8, 8))
    assert needed_ranks(f, t, 0) == [0, 1, 2, 3]
    f, t = FlatLayout((3, 2), (0,), (4,)), FlatLayout((2, 3), (1,), (4,))
    assert needed_ranks(f, t, 3) == [2, 3]  # not refinable: fallback
    f, t = FlatLayout((2, 2), (1, -1), (8, 4)), FlatLayout((4,), (-1, 0), (8, 4))
    assert [needed_ranks(f, t, r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_l8_and_redundancy_vectors() -> None:
    # L8 and further cases verified against get_parameter_redundancy (see the oracle test)
    assert redundancy_groups(P((2, 2), (-1, 0), 2, 2)) == ((0,), (2,), (1,), (3,))
    assert redundancy_groups(P((2, 2, 2), (0, 1))) == ((0, 4), (2, 6), (1, 5), (3, 7))
    assert redundancy_groups(P((2, 2, 2), (0, -1, 2))) == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert redundancy_groups(P((4, 2), (-1, 0), 2, -1)) == ((0,), (2,), (4,), (6,), (1,), (3,), (5,), (7,))
    assert redundancy_groups(P((4, 2), (-1, 0), 2, 3)) == ()  # silently dropped [quirk]
    assert redundancy_groups(P((8,), (-1, -1), 1, 4)) == ((0, 4), (1, 5), (2, 6), (3, 7))
    # list maps: only the first dim's list is read [quirk]
    assert redundancy_groups(P((2, 2, 2), ((2,), (1, 0)))) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert redundancy_groups(P((2, 2), (-1, 0), 2, 2), initial_rank=8) == ((8,), (10,), (9,), (11,))


P1 = {
    "0-emb": P((2,), (0, -1)),
    "0-w0": P((2,), (-1, 0)),
    "1-emb": P((2,), (-1, 0)),
    "1-w1": P((2,), (0, -1)),
}


def test_p2_pipeline_destination() -> None:
    full = (4, 4)
    for rank in range(4):
        dst = layout_map(P1, rank)
        stage, local = rank // 2, rank % 2
        names = {k for k, v in dst.items() if stage in v.stages}
        assert names == ({"emb", "w0"} if stage == 0 else {"emb", "w1"})
        emb = rank_box(dst["emb"].layout, full, local)
        half = (2 * local, 2 * local + 2)
        assert emb == ((half, (0, 4)) if stage == 0 else ((0, 4), half))
        assert transfer_pieces(None, dst["emb"].layout, full, local) == [(0, emb)]


def test_p3_pipeline_to_single_stage() -> None:
    dst = {"emb": P((2,), (-1, -1)), "w0": P((2,), (0, -1)), "w1": P((2,), (-1, -1))}
    assert [ms_rank_list(r, P1, dst) for r in range(2)] == [[3, 2, 1, 0], [3, 2, 1, 0]]
    # full -> P1 needs the single full file; P1 -> nothing (merge) needs every stage
    assert ms_rank_list(3, None, P1) == [0]
    assert ms_rank_list(0, P1, None) == [3, 2, 1, 0]


# --------------------------------------------------------------------------------------------
# further unit cases


def test_list_map_expansion() -> None:
    p = P((4, 2, 2), ((2, 1), (0,)))
    assert flat_layout(p, (8, 8)) == FlatLayout((4, 2, 2), (2, 1, 0), (4, 2, 8))
    assert tensor_strategy(p) == (8, 2)
    # rank 5 = coords (1, 0, 1): dim 0 block 1*2 + 0 = 2 of 8, dim 1 block 1 of 2
    assert rank_box(p, (8, 8), 5) == ((2, 3), (4, 8))


def test_opt_shard_helper_path_splits_a_dev_dim() -> None:
    # repeat dims 0 and 2 (helper path); size 2 < dev[2] = 4 -> dev dim 2 split into [2, 2]
    p = P((2, 2, 4), (-1, 1), opt_shard_step=1, opt_shard_size=2)
    assert flat_layout(p, (4, 4)) == FlatLayout((2, 2, 2, 2), (-1, 0, 2), (1, 4, 4))
    assert slice_shape(p, (4, 4)) == (2, 2)
    assert rank_box(p, (4, 4), 0) == ((0, 2), (0, 2))
    assert rank_box(p, (4, 4), 1) == ((2, 4), (0, 2))
    assert rank_box(p, (4, 4), 2) == ((0, 2), (0, 2))  # inner half of dev dim 2 is the opt axis


def test_opt_shard_size_minus_one_and_list_map() -> None:
    p = P((2, 2, 2, 2), ((1, 0), (-1,)), opt_shard_step=4, opt_shard_size=-1)
    assert opt_shard_size(p) == 4
    assert full_shape(p, (1, 2)) == (16, 2)
    flat = flat_layout(p, (16, 2))
    assert flat.dev == (2, 2, 2, 2) and flat.shape == (2, 2, 2, 2, 2)
    assert slice_shape(p, (16, 2)) == (1, 2)


def test_errors() -> None:
    with pytest.raises(LayoutError, match="does not divide"):
        slice_shape(P((2, 2), (1, -1)), (3, 4))
    with pytest.raises(LayoutError, match="does not divide"):
        rank_box(P((2, 2), (1, -1)), (3, 4), 0)
    with pytest.raises(LayoutError, match="step"):
        flat_layout(P((2, 2), (-1, 0), opt_shard_step=1, opt_shard_size=2), (4, 4))
    with pytest.raises(LayoutError, match="repeated device dim"):
        flat_layout(P((2, 2), (1, 0), opt_shard_step=1, opt_shard_size=2), (4, 4))
    with pytest.raises(LayoutError, match="does not divide dev dim"):
        flat_layout(P((2, 3, 2), (-1, 0), opt_shard_step=4, opt_shard_size=2), (6, 6))  # helper: 3 % 2
    with pytest.raises(LayoutError, match="step\\*size"):
        flat_layout(P((4, 4), (-1,), opt_shard_step=6, opt_shard_size=4), (8,))
    with pytest.raises(LayoutError, match="opt_shard_size without"):
        flat_layout(P((2, 2), (-1, 0), opt_shard_step=0, opt_shard_size=2), (4, 4))
    with pytest.raises(LayoutError, match="outside"):
        tensor_strategy(P((2,), (1,)))
    with pytest.raises(LayoutError, match="used twice"):
        tensor_strategy(P((2, 2), (0, 0)))
    with pytest.raises(LayoutError, match="dims"):
        full_shape(P((2,), (0, -1)), (4,))
    with pytest.raises(LayoutError, match="outside the 4 devices"):
        rank_box(P((2, 2), (1, -1)), W84, 4)
    with pytest.raises(LayoutError, match="Cannot transform device_num"):
        needed_ranks(FlatLayout((4,), (0,), (12,)), FlatLayout((6,), (0,), (12,)), 0)
    with pytest.raises(LayoutError, match="Cannot transform device_num"):
        transfer_pieces(P((4,), (0,)), P((6,), (0,)), (12,), 0)
    with pytest.raises(LayoutError, match="hold different tensors"):
        needed_ranks(FlatLayout((2,), (0,), (4,)), FlatLayout((2,), (0,), (6,)), 0)
    with pytest.raises(UnsupportedError, match="-1 inside"):
        tensor_strategy(P((2, 2), ((-1, 0),)))
    with pytest.raises(UnsupportedError, match="zero-element"):
        needed_ranks(FlatLayout((2,), (0,), (0,)), FlatLayout((2,), (-1,), (0,)), 0)
    with pytest.raises(LayoutError, match="src_strategy_file is empty"):
        rank_list_for_transform(0, {}, None)


def test_inputs_numpy_ints_and_bad_types() -> None:
    p = P((2, 2), (1, -1))
    assert rank_box(p, np.array([8, 4]), np.int64(3)) == rows(4, 8)
    assert transfer_pieces(p, None, (np.int64(8), 4), np.int32(0)) == [(0, rows(0, 4)), (2, rows(4, 8))]
    with pytest.raises(LayoutError, match="not a shape"):
        rank_box(p, (8.0, 4), 0)
    with pytest.raises(LayoutError, match="not an integer"):
        rank_box(p, W84, 1.0)
    with pytest.raises(LayoutError, match="opt_shard_size without"):
        full_shape(P((2, 2), (-1, 0), opt_shard_step=0, opt_shard_size=-1), (2, 2))


def test_needed_ranks_beyond_range_only_when_nothing_moves() -> None:
    # MindSpore answers [rank] for any rank when the two layouts place the same data everywhere
    same = FlatLayout((2, 2), (1, -1), (4, 4)), FlatLayout((2, 2), (1, -1), (2, 8))
    assert needed_ranks(*same, 5) == [5]
    unsplit = FlatLayout((2, 3), (-1,), (6,)), FlatLayout((3, 2), (-1,), (6,))  # not refinable, no split
    assert needed_ranks(*unsplit, 7) == [7]
    with pytest.raises(LayoutError, match="outside the 2 devices"):
        needed_ranks(FlatLayout((2,), (-1,), (4,)), FlatLayout((2,), (0,), (4,)), 2)  # a local slice


def test_non_box_flat_layout_is_unsupported() -> None:
    # dim 0 of the full tensor (4) as flat (2, 2) with the *outer* factor whole and the inner split:
    # rank 0 would hold indices {0, 2}, not an interval
    with pytest.raises(UnsupportedError, match="not a box"):
        flat_rank_box(FlatLayout((2,), (-1, 0), (2, 2)), 0, (4,))
    assert flat_rank_box(FlatLayout((2,), (0, -1), (2, 2)), 1, (4,)) == ((2, 4),)


def test_zero_sized_and_scalar() -> None:
    p = P((2, 2), (1, -1))
    assert rank_box(p, (0, 4), 3) == ((0, 0), (0, 4))
    assert transfer_pieces(p, None, (0, 4), 0) == []
    scalar = P((2, 2), ())
    assert rank_box(scalar, (), 3) == ()
    assert transfer_pieces(scalar, P((4,), ()), (), 2) == [(2, ())]
    assert transfer_pieces(scalar, None, (), 0) == [(0, ())]


def test_opt_size_one_is_no_shard() -> None:
    p = P((2, 2), (-1, 0), opt_shard_step=2, opt_shard_size=1)
    assert flat_layout(p, (4, 4)) == flat_layout(P((2, 2), (-1, 0)), (4, 4))


def test_merge_uses_copy_with_zero_repeat_coordinates() -> None:
    # dst None (full tensor): MindSpore takes rank 0 rather than rank 1 for dev [2,2] tmap [1,-1]
    assert transfer_pieces(P((2, 2), (1, -1)), None, W84, 0) == [(0, rows(0, 4)), (2, rows(4, 8))]
    # dst rank 1 of a same-shaped layout keeps its own coordinate on the untouched axis
    assert transfer_pieces(P((2, 2), (1, -1)), P((4,), (0, -1)), W84, 1) == [(1, rows(2, 4))]


def test_beyond_mindspore_device_counts() -> None:
    src, dst = P((2, 2), (1, -1)), P((3, 2), (1, -1))  # 4 -> 6 ranks, rows split 2 -> 3
    full = (12, 4)
    assert transfer_pieces(src, dst, full, 1, any_device_num=True) == [(0, ((0, 4), (0, 4)))]
    assert transfer_pieces(src, dst, full, 2, any_device_num=True) == [
        (0, ((4, 6), (0, 4))),
        (2, ((6, 8), (0, 4))),
    ]
    # divisible counts: the flag changes nothing
    same = P((2, 2, 2), (2, -1))
    assert transfer_pieces(src, same, (8, 4), 5, any_device_num=True) == transfer_pieces(src, same, (8, 4), 5)


def test_transfer_table_matches_per_rank() -> None:
    src, dst = P((4, 2), (1, 0)), P((2, 4), (1, 0))
    table = transfer_table(src, dst, [8, 8])
    assert len(table) == 8
    assert all(list(table[r]) == transfer_pieces(src, dst, (8, 8), r) for r in range(8))


def test_rank_list_first_item_device_number() -> None:
    # MindSpore reads "devices per stage" from the first layout item; explicit values override it
    src = layout_map({"0-a": P((2,), (0,)), "1-a": P((2,), (0,))})
    assert rank_list_for_transform(0, src, None) == [3, 2, 1, 0]
    assert rank_list_for_transform(0, src, None, src_first=4) == [5, 4, 1, 0]
    assert rank_list_for_transform(0, src, None, src_first=P((4,), (0,))) == [5, 4, 1, 0]


# --------------------------------------------------------------------------------------------
# property tests

SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(rng=st.randoms(use_true_random=False))
def test_boxes_match_naive_reference_and_cover(rng: random.Random) -> None:
    p = random_layout(rng)
    shape = random_full(rng, p)
    full = arange(shape)
    seen = np.zeros(shape, dtype=np.int64)
    for r in range(p.device_num):
        box = rank_box(p, shape, r)
        assert np.array_equal(cut(full, box), naive_slice(p, full, r)), (p, shape, r)
        seen[tuple(slice(lo, hi) for lo, hi in box)] += 1
    # every element held, and by the same number of (redundant) ranks
    assert (seen == p.device_num // math.prod(parts(p))).all()
    flat = flat_layout(p, shape)
    assert all(flat_rank_box(flat, r, shape) == rank_box(p, shape, r) for r in range(p.device_num))


@SETTINGS
@given(rng=st.randoms(use_true_random=False))
def test_transfer_pieces_tile_and_assemble(rng: random.Random) -> None:
    src, dst, shape = random_pair(rng)
    full = arange(shape)
    n_src = src.device_num if src else 1
    n_dst = dst.device_num if dst else 1
    divides = max(n_src, n_dst) % min(n_src, n_dst) == 0
    if not divides:
        with pytest.raises(LayoutError, match="Cannot transform device_num"):
            transfer_pieces(src, dst, shape, 0)
    src_data = [naive_slice(src, full, r) for r in range(n_src)]
    for r in range(n_dst):
        dst_box = rank_box(dst, shape, r) if dst else tuple((0, s) for s in shape)
        pieces = transfer_pieces(src, dst, shape, r, any_device_num=not divides)
        out = np.full([hi - lo for lo, hi in dst_box], -1, dtype=np.int64)
        for s, box in pieces:
            assert 0 <= s < n_src
            held = rank_box(src, shape, s) if src else tuple((0, d) for d in shape)
            assert all(h0 <= b0 < b1 <= h1 for (b0, b1), (h0, h1) in zip(box, held, strict=True))
            assert all(d0 <= b0 < b1 <= d1 for (b0, b1), (d0, d1) in zip(box, dst_box, strict=True))
            target = tuple(slice(b0 - d0, b1 - d0) for (b0, b1), (d0, _) in zip(box, dst_box, strict=True))
            assert (out[target] == -1).all(), "overlapping pieces"
            source = tuple(slice(b0 - h0, b1 - h0) for (b0, b1), (h0, _) in zip(box, held, strict=True))
            out[target] = src_data[s][source]
        assert np.array_equal(out, naive_slice(dst, full, r))


@SETTINGS
@given(rng=st.randoms(use_true_random=False))
def test_needed_ranks_structure(rng: random.Random) -> None:
    src, dst, shape = random_pair(rng)
    if src is None or dst is None:
        return
    f, t = flat_layout(src, shape), flat_layout(dst, shape)
    try:
        f, t = normalize_device_num(f, t)
    except LayoutError:
        return
    lists = [needed_ranks(f, t, r) for r in range(f.device_num)]
    assert all(r in lst and lst == sorted(set(lst)) for r, lst in enumerate(lists))
    assert len({len(lst) for lst in lists}) == 1
    # a rank's list is a class of an equivalence: s needed by r <=> r's list == s's list
    assert all(lists[s] == lst for lst in lists for s in lst)


@settings(max_examples=60, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_beyond_mindspore_prefers_lowest_copy(rng: random.Random) -> None:
    ndim = rng.randint(1, 2)
    src, dst = random_layout(rng, ndim, opt=False), random_layout(rng, ndim, opt=False)
    shape = tuple(math.lcm(a, b) for a, b in zip(parts(src), parts(dst), strict=True))
    n_src, n_dst = src.device_num, dst.device_num
    if max(n_src, n_dst) % min(n_src, n_dst) == 0:
        return  # MindSpore's own copy rule applies (tested elsewhere)
    for r in range(dst.device_num):
        for s, box in transfer_pieces(src, dst, shape, r, any_device_num=True):
            holders = [k for k in range(src.device_num) if _inside(box, rank_box(src, shape, k))]
            assert s == min(holders)


def _inside(box: tuple[tuple[int, int], ...], outer: tuple[tuple[int, int], ...]) -> bool:
    return all(o0 <= b0 and b1 <= o1 for (b0, b1), (o0, o1) in zip(box, outer, strict=True))


def test_rank_list_union_matches_needed_ranks() -> None:
    rng = random.Random(7)
    for _ in range(40):
        src, dst, _shape = random_pair(rng)
        if src is None:
            continue
        n_src, n_dst = src.device_num, (dst.device_num if dst else 1)
        if max(n_src, n_dst) % min(n_src, n_dst):
            continue
        rank = rng.randrange(n_dst)
        got = ms_rank_list(rank, {"x": src}, {"x": dst} if dst else None)
        fake = full_shape(src, [max(n_src, n_dst)] * len(src.tensor_map))
        f = flat_layout(src, fake)
        t = flat_layout(dst, fake) if dst else FlatLayout((1,), (-1,) * len(fake), fake)
        assert got == sorted({s % n_src for s in needed_ranks(f, t, rank)}, reverse=True)
