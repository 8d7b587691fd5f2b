"""Chunk boxes (reshard.layout.chunks) against a naive "materialise, then slice" reference.

The reference holds the global tensor as ``arange`` and every chunk as the slice of it its box
names; a destination box is then filled from the pieces ``ChunkIndex.pieces`` returns, and must
equal the global tensor's slice with every element written exactly once. Chunkings are grids
(even, uneven, ``torch.chunk``-style) and arbitrary guillotine tilings that are no grid, with
replicas and empty chunks mixed in; broken chunkings (a chunk outside, a partial overlap, a hole)
must raise one ``LayoutError`` naming the tensor.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.errors import LayoutError, UsageError
from reshard.formats import checkpoint2 as cp2
from reshard.layout import Box, ParamLayout, rank_boxes
from reshard.layout.chunks import (
    Chunk,
    ChunkedTensor,
    ChunkIndex,
    even_boxes,
    grid_boxes,
    grid_chunks,
    layout_chunks,
    whole_box,
    whole_chunks,
)

F32 = dtypes.FLOAT32


def region(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@st.composite
def shapes(draw: st.DrawFn, min_dims: int = 0) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 7), min_size=min_dims, max_size=3)))


@st.composite
def grid_tilings(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """An uneven grid: every dim cut into random consecutive blocks."""
    sizes = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        edges = [0, *cuts, n]
        sizes.append([b - a for a, b in itertools.pairwise(edges)])
    return list(grid_boxes(shape, sizes))


@st.composite
def guillotine_tilings(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A tiling by recursive cuts of random boxes along random dims: in general no grid."""
    boxes = [whole_box(shape)]
    for _ in range(draw(st.integers(0, 6))):
        k = draw(st.integers(0, len(boxes) - 1))
        box = boxes[k]
        dims = [d for d, (a, b) in enumerate(box) if b - a > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        a, b = box[d]
        cut = draw(st.integers(a + 1, b - 1))
        boxes[k : k + 1] = [
            (*box[:d], (a, cut), *box[d + 1 :]),
            (*box[:d], (cut, b), *box[d + 1 :]),
        ]
    return boxes


@st.composite
def chunkings(draw: st.DrawFn, min_dims: int = 0) -> ChunkedTensor:
    """A tensor and its chunks: a tiling, shuffled, with replicas and empty chunks added."""
    shape = draw(shapes(min_dims))
    boxes = draw(st.one_of(grid_tilings(shape), guillotine_tilings(shape)))
    boxes = boxes + [draw(st.sampled_from(boxes)) for _ in range(draw(st.integers(0, 2)))]  # replicas
    if shape and draw(st.booleans()):
        d = draw(st.integers(0, len(shape) - 1))
        boxes.append(tuple((0, 0) if j == d else (0, n) for j, n in enumerate(shape)))  # an empty chunk
    draw(st.randoms()).shuffle(boxes)
    files = tuple(f"file{i % 3}" for i in range(len(boxes)))
    tensors = tuple(f"w.{i}" for i in range(len(boxes)))
    return ChunkedTensor("w", shape, F32, tuple(boxes), files, tensors)


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    out = []
    for n in shape:
        a = draw(st.integers(0, n))
        out.append((a, draw(st.integers(a, n))))
    return tuple(out)


def materialise(tensor: ChunkedTensor, box: Box, index: ChunkIndex) -> np.ndarray:
    """``box`` of the tensor assembled from the chunks' data along ``index.pieces``."""
    full = np.arange(math.prod(tensor.shape)).reshape(tensor.shape)
    held = {(tensor.files[i], tensor.tensor_of(i)): full[region(b)] for i, b in enumerate(tensor.boxes)}
    shape = tuple(b - a for a, b in box)
    out = np.full(shape, -1)
    seen = np.zeros(shape, dtype=int)
    for k, piece in index.pieces(box):
        chunk = tensor.boxes[k]
        assert all(c0 <= a and b <= c1 for (a, b), (c0, c1) in zip(piece, chunk, strict=True))
        src = held[(tensor.files[k], tensor.tensor_of(k))]
        src_region = tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(piece, chunk, strict=True))
        dst_region = tuple(slice(a - d0, b - d0) for (a, b), (d0, _) in zip(piece, box, strict=True))
        out[dst_region] = src[src_region]
        seen[dst_region] += 1
    assert (seen == 1).all(), "pieces do not cover the box exactly once"
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_pieces_match_slicing(data: st.DataObject) -> None:
    tensor = data.draw(chunkings())
    index = ChunkIndex(tensor)
    for _ in range(3):
        box = data.draw(boxes_in(tensor.shape))
        full = np.arange(math.prod(tensor.shape)).reshape(tensor.shape)
        np.testing.assert_array_equal(materialise(tensor, box, index), full[region(box)])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_pieces_are_row_major_and_replicas_read_once(data: st.DataObject) -> None:
    tensor = data.draw(chunkings())
    index = ChunkIndex(tensor)
    pieces = index.pieces(whole_box(tensor.shape))
    starts = [tuple(a for a, _ in tensor.boxes[k]) for k, _ in pieces]
    assert starts == sorted(starts)
    used = [tensor.boxes[k] for k, _ in pieces]
    assert len(set(used)) == len(used)
    first = {}
    for i, b in enumerate(tensor.boxes):
        first.setdefault(b, i)
    assert all(first[tensor.boxes[k]] == k for k, _ in pieces), "a replica other than the first was used"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_grid_and_general_paths_agree(data: st.DataObject) -> None:
    """A grid answered by bisecting its cuts and by the first dimension's sort give the same pieces."""
    shape = data.draw(shapes(1))
    boxes = tuple(data.draw(grid_tilings(shape)))
    tensor = ChunkedTensor("w", shape, F32, boxes, ("f",) * len(boxes), tuple(f"t{i}" for i in range(len(boxes))))
    grid = ChunkIndex(tensor)
    assert grid.is_grid
    general = ChunkIndex(tensor)
    general._grid = None  # the general path on the same chunks
    general._starts = [b[0][0] for b in general.boxes]
    general._reach = max(b[0][1] - b[0][0] for b in general.boxes)
    for _ in range(3):
        box = data.draw(boxes_in(shape))
        assert grid.pieces(box) == general.pieces(box)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_broken_chunkings_raise(data: st.DataObject) -> None:
    shape = data.draw(shapes(1))
    boxes = data.draw(st.one_of(grid_tilings(shape), guillotine_tilings(shape)))
    kind = data.draw(st.sampled_from(["hole", "outside", "overlap"]))
    k = data.draw(st.integers(0, len(boxes) - 1))
    if kind == "hole":
        if len(boxes) == 1:
            boxes = [tuple((a, b - 1) if d == 0 else (a, b) for d, (a, b) in enumerate(boxes[0]))]
            if any(a == b for a, b in boxes[0]):
                boxes = []
        else:
            del boxes[k]
        message = "a hole"
    elif kind == "outside":
        d = data.draw(st.integers(0, len(shape) - 1))
        boxes[k] = tuple((a, shape[d] + 1) if j == d else (a, b) for j, (a, b) in enumerate(boxes[k]))
        message = "lies outside the tensor"
    else:
        big = [b for b in boxes if any(hi - lo > 1 for lo, hi in b)]
        if len(boxes) < 2 or not big:
            return
        box = big[0]
        d = next(j for j, (lo, hi) in enumerate(box) if hi - lo > 1)
        boxes.append(tuple((lo, hi - 1) if j == d else (lo, hi) for j, (lo, hi) in enumerate(box)))
        message = "overlap without being the same box"
    tensor = ChunkedTensor("w", shape, F32, tuple(boxes), ("f",) * len(boxes))
    with pytest.raises(LayoutError, match=message) as caught:
        ChunkIndex(tensor)
    assert "'w'" in str(caught.value)


def test_messages_name_the_files() -> None:
    shape = (4, 4)
    boxes = (((0, 4), (0, 2)), ((0, 3), (1, 4)))
    tensor = ChunkedTensor("w", shape, F32, boxes, ("a.distcp", "b.distcp"))
    with pytest.raises(LayoutError, match=r"chunks \[0:4, 0:2\] of a.distcp and \[0:3, 1:4\] of b.distcp overlap"):
        ChunkIndex(tensor)
    with pytest.raises(LayoutError, match=r"chunks hold 8 of its 16 elements"):
        ChunkIndex(ChunkedTensor("w", shape, F32, boxes[:1], ("a.distcp",)))
    with pytest.raises(UsageError, match="2 chunk boxes but 1 files"):
        ChunkedTensor("w", shape, F32, boxes, ("a",))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9))
def test_even_boxes_are_torch_chunk(rows: int, parts: int) -> None:
    """``torch.chunk``: ceil(rows / parts) rows each, the rest short; DTensor's trailing ranks empty."""
    boxes = even_boxes((rows, 3), 0, parts)
    step = -(-rows // parts)
    assert len(boxes) == parts
    assert [b[0] for b in boxes] == [(min(k * step, rows), min((k + 1) * step, rows)) for k in range(parts)]
    assert all(b[1] == (0, 3) for b in boxes)
    chunked = [len(c) for c in np.array_split(np.arange(rows), range(step, rows, step))] if rows and step else []
    assert [b - a for a, b in (b[0] for b in boxes) if b > a] == [n for n in chunked if n]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 600), st.integers(1, 9), st.integers(1, 160))
def test_even_boxes_in_whole_groups_are_torch_chunk_of_the_groups(rows: int, parts: int, grain: int) -> None:
    """Rows cut in whole groups of ``grain`` (an FP8 weight's block rows): the groups as ``torch.chunk``
    cuts them, so part k's rows are exactly the rows of part k of the groups (its scale's rows)."""
    boxes = even_boxes((rows, 2), 0, parts, grain)
    groups = even_boxes((-(-rows // grain), 2), 0, parts)
    assert len(boxes) == parts
    for (a, b), (ga, gb) in zip((b[0] for b in boxes), (g[0] for g in groups), strict=True):
        assert (a, b) == (min(ga * grain, rows), min(gb * grain, rows))
    assert even_boxes((rows, 2), 0, parts, 1) == even_boxes((rows, 2), 0, parts)


def test_whole_and_layout_and_grid_compilers() -> None:
    t = whole_chunks("w", (3, 2), F32, "model.safetensors")
    assert t.chunks == (Chunk(((0, 3), (0, 2)), "model.safetensors", "w"),)
    p = ParamLayout((2, 2), (1, -1))  # rows split in 2, replicated twice
    t = layout_chunks("w", p, (4, 6), F32, {1: "r1", 2: "r2", 3: "r3"}, tensor="w")
    assert t.boxes == (rank_boxes(p, (4, 6))[1], rank_boxes(p, (4, 6))[2])  # rank 0 absent: its replica rank 1
    assert t.files == ("r1", "r2")
    with pytest.raises(LayoutError, match="no source file holds the slice of rank 2"):
        layout_chunks("w", p, (4, 6), F32, {0: "r0", 1: "r1"})
    homes = {i: (f"f{i}", f"w{i}") for i in range(4)}
    g = grid_chunks("w", (4, 6), F32, (2, 2), homes)
    for i in range(4):
        assert g.boxes[i] == cp2.chunk_box(cp2.Chunk(i, (2, 3)), (2, 2))
        assert g.chunk(i) == Chunk(g.boxes[i], f"f{i}", f"w{i}")
    with pytest.raises(LayoutError, match="slice 3 is held by no file"):
        grid_chunks("w", (4, 6), F32, (2, 2), {i: homes[i] for i in range(3)})
    with pytest.raises(LayoutError, match="do not divide"):
        grid_chunks("w", (5, 6), F32, (2, 2), homes)


def test_of_chunks_round_trips() -> None:
    chunks = [Chunk(((0, 2),), "a", "x"), Chunk(((2, 5),), "b", "x")]
    t = ChunkedTensor.of_chunks("x", (5,), F32, chunks)
    assert t.tensors is None and t.chunks == tuple(chunks)
    chunks[1] = Chunk(((2, 5),), "b", "x.1")
    assert ChunkedTensor.of_chunks("x", (5,), F32, chunks).tensors == ("x", "x.1")


def test_a_scalar_and_an_empty_tensor() -> None:
    scalar = ChunkIndex(ChunkedTensor("s", (), F32, ((),), ("f",)))
    assert scalar.pieces(()) == [(0, ())]
    empty = ChunkIndex(ChunkedTensor("e", (0, 3), F32, (((0, 0), (0, 3)),), ("f",)))
    assert empty.pieces(((0, 0), (0, 3))) == []
