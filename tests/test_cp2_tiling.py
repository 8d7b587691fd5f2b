"""``metadata.json``'s one consistency check of a tensor's chunks (docs/formats.md §13.4), by property:
over generated layouts (or none), grids and chunk sets, ``read_metadata`` accepts exactly when the
chunks are the blocks the layout gives its ranks and tile the global shape once (no gap, no
overlap), as a naive reference finds by painting every chunk into an array of counts; whatever it
accepts is planned from the tensor's real blocks."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import FormatError
from reshard.formats import checkpoint2 as cp2
from reshard.layout import ParamLayout
from reshard.layout.algebra import rank_boxes

Box = tuple[tuple[int, int], ...]
Case = tuple[tuple[int, ...] | None, tuple[object, ...], tuple[int, ...], tuple[int, ...], list[int]]
# (device matrix, None: no layout), tensor map, global shape, axis_fragmentations, chunk slice ids


def _grid_box(slice_id: int, frags: Sequence[int], shape: Sequence[int]) -> Box:
    """The reference's block ``slice_id`` of the row-major grid ``frags`` over ``shape``."""
    coord = np.unravel_index(slice_id, tuple(frags))
    sizes = [s // f for s, f in zip(shape, frags, strict=True)]
    return tuple((int(c) * n, (int(c) + 1) * n) for c, n in zip(coord, sizes, strict=True))


def _consistent(dev: tuple[int, ...] | None, tmap: Case[1], shape: Case[2], frags: Case[3], ids: list[int]) -> bool:
    """Naive: each element in exactly one chunk, and the chunks are the boxes the layout gives the ranks."""
    count = np.zeros(shape, dtype=np.int64)
    boxes = {_grid_box(i, frags, shape) for i in ids}
    for box in boxes:
        count[tuple(slice(a, b) for a, b in box)] += 1
    if not (count == 1).all():
        return False
    layout = None if dev is None else ParamLayout(dev, tuple(e if isinstance(e, int) else tuple(e) for e in tmap))
    return boxes == set(rank_boxes(layout, shape))


@st.composite
def _tensors(draw: st.DrawFn) -> Case:
    dev = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    axes = draw(st.permutations(range(len(dev))))
    tmap: list[object] = []
    for _ in range(ndim):
        pick = draw(st.sampled_from(["none", "one", "two"]))
        free = [a for a in axes if all(a != v and not (isinstance(v, list) and a in v) for v in tmap)]
        if pick == "one" and free:
            tmap.append(free[0])
        elif pick == "two" and len(free) >= 2:
            tmap.append(free[:2])  # a dimension split over two axes, the first the major one
        else:
            tmap.append(-1)
    layout_frags = tuple(
        math.prod(dev[len(dev) - 1 - v] for v in (e if isinstance(e, list) else [e]) if v != -1) for e in tmap
    )
    frags = layout_frags
    if draw(st.booleans()):  # another grid than the layout's, now and then
        frags = tuple(draw(st.sampled_from([1, 2, 4])) for _ in range(ndim))
    shape = tuple(math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(layout_frags, frags, strict=True))
    cells = math.prod(frags)
    how = draw(st.sampled_from(["all", "all", "drop", "subset"]))
    ids = list(range(cells))
    if how == "drop" and cells > 1:
        ids.remove(draw(st.integers(0, cells - 1)))
    elif how == "subset":
        ids = sorted(draw(st.sets(st.integers(0, cells - 1), min_size=1)))
    layout = None if draw(st.integers(0, 3)) == 0 else dev
    return layout, tuple(tmap), shape, frags, ids


def _metadata(dev: tuple[int, ...] | None, tmap: Case[1], shape: Case[2], frags: Case[3], ids: list[int]) -> dict:
    local = [s // f for s, f in zip(shape, frags, strict=True)]
    layout = None
    if dev is not None:
        ranks = list(range(math.prod(dev)))
        alias = [f"axis{len(dev) - 1 - i}" for i in range(len(dev))]
        layout = {"device_matrix": list(dev), "tensor_map": list(tmap), "interleaved_parallel": False,
                  "alias_name": alias, "rank_list": ranks}  # fmt: skip
    entry = {
        "properties": {"dtype": "Float32", "allow_shape_mismatch": False, "allow_to_save": True},
        "global_shape": list(shape),
        "axis_fragmentations": list(frags),
        "layout": layout,
        "chunk": [{"global_offset": [i], "local_shape": local} for i in ids],
    }
    storage = {str(("w", (i,))): [{"file_name": f"model-{i:07d}.safetensors", "storage_rank": i}] for i in ids}
    return {"state_dict_metadata": {"w": entry}, "storage_data": storage}


def _read(meta: dict[str, object]) -> cp2.Metadata:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "metadata.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(meta, fh)
        return cp2.read_metadata(path)


@settings(max_examples=300, deadline=None)
@given(_tensors())
def test_accepted_exactly_when_the_chunks_are_the_layouts_blocks_tiling_the_tensor(
    case: Case,
) -> None:
    dev, tmap, shape, frags, ids = case
    expected = _consistent(dev, tmap, shape, frags, ids)
    try:
        md = _read(_metadata(dev, tmap, shape, frags, ids))
    except FormatError as exc:
        assert not expected, exc
        assert "tensor 'w'" in str(exc) and "metadata.json" in str(exc)
        return
    assert expected, case
    chunks = md.tensors["w"].chunks
    assert {cp2.chunk_box(c, frags) for c in chunks} == {_grid_box(i, frags, shape) for i in ids}


def test_a_tensor_without_a_layout_is_one_whole_chunk() -> None:
    """The user's case: ``layout: null`` on a tensor its chunks still cut in 2 (MindFormers saves a
    layout-less tensor whole: axis_fragmentations all 1, one chunk)."""
    meta = _metadata((2, 2), (0, -1), (128, 128), (2, 1), [0, 1])
    meta["state_dict_metadata"]["w"]["layout"] = None  # type: ignore[index]
    with pytest.raises(FormatError, match=r"axis_fragmentations are \[2, 1\], but it has no layout"):
        _read(meta)
    assert _read(_metadata(None, (-1, -1), (128, 128), (1, 1), [0])).tensors["w"].layout is None


def test_a_layout_mindspore_refuses_is_a_format_error() -> None:
    meta = _metadata((2, 2), (0, 0), (4, 4), (2, 2), [0, 1, 2, 3])  # one device axis for both dims
    with pytest.raises(FormatError, match="used twice"):
        _read(meta)


def test_two_slices_stored_in_one_file_are_refused() -> None:
    meta = _metadata((2,), (0,), (4,), (2,), [0, 1])
    storage = meta["storage_data"]
    storage[str(("w", (1,)))] = storage[str(("w", (0,)))]  # type: ignore[index]
    with pytest.raises(FormatError, match="holds one 'w', but storage_data stores slices 0 and 1"):
        _read(meta)
