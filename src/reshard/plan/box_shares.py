"""Every share of one box class at once, in numpy, when its chunks form a grid.

``plan.boxes.relative_share`` intersects one destination box with the chunks, piece by piece in
Python (some 5 us a piece). A class of a DCP checkpoint of 4 096 ranks written into 1 024 has 4 096
pieces over its 1 024 shares, and a checkpoint with a shape per parameter has thousands of classes.
When the chunks are a grid (``ChunkIndex.grid``: every DTensor placement, uneven ones included),
the pieces of every destination box are found together: per dimension, the cuts a box spans by
``searchsorted``; each box's pieces are the row-major product of its spans, enumerated for all boxes
at once by unravelling one running index. A share's copies stay columns (``GridCopies``) until
they are used: planning counts them and reads their chunks' files only. The shares
are the ones ``relative_share`` gives, copy for copy (``tests/test_plan_boxes.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from reshard.layout import Box
from reshard.layout.chunks import ChunkedTensor, ChunkIndex

RelativeCopy = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]  # as plan.boxes has it
ShareParts = tuple[tuple[int, ...], Sequence[RelativeCopy], int, int]  # plan.boxes.Share's fields


def grid_index(tensor: ChunkedTensor) -> ChunkIndex | None:
    """``ChunkIndex(tensor)`` found on columns when the chunks form a grid (the same ``used``, cuts and
    cells); None otherwise (a box outside, no grid, no dimension, no chunk: ``ChunkIndex`` checks and
    says what is wrong)."""
    ndim, n = len(tensor.shape), len(tensor.boxes)
    if not ndim or not n:
        return None
    boxes = np.array(tensor.boxes, dtype=np.int64).reshape(n, ndim, 2)
    lo, hi = boxes[:, :, 0], boxes[:, :, 1]
    if not ((lo >= 0) & (lo <= hi) & (hi <= np.array(tensor.shape, dtype=np.int64))).all():
        return None
    rows = np.flatnonzero((hi > lo).all(axis=1))  # empty chunks hold nothing to read
    _, first = np.unique(boxes[rows].reshape(len(rows), 2 * ndim), axis=0, return_index=True)
    kept = rows[np.sort(first)]  # the first chunk of each distinct box: replicas after it are not read
    used = kept[np.lexsort(lo[kept].T[::-1])]  # by start, row-major (a stable sort, as ChunkIndex's)
    if not len(used):
        return None
    cuts = [np.unique(np.concatenate(([0, size], lo[used, d], hi[used, d]))) for d, size in enumerate(tensor.shape)]
    if math.prod(len(c) - 1 for c in cuts) != len(used):
        return None
    at = np.stack([np.searchsorted(cuts[d], lo[used, d]) for d in range(ndim)], axis=1)
    ends = np.stack([np.searchsorted(cuts[d], hi[used, d]) for d in range(ndim)], axis=1)
    if not (ends == at + 1).all():
        return None  # a chunk spanning several cells: no grid
    cell = np.ravel_multi_index(tuple(at.T), tuple(len(c) - 1 for c in cuts))
    cells = np.full(len(used), -1, dtype=np.int64)
    cells[cell] = np.arange(len(used))
    if (cells < 0).any():
        return None  # two chunks in one cell
    return ChunkIndex.of_grid(tensor, used.tolist(), [c.tolist() for c in cuts], cells.tolist())


def grid_shares(index: ChunkIndex, dst: Sequence[Box | None]) -> dict[int, ShareParts] | None:
    """The share of every destination box (by its position in ``dst``; None boxes left out) from the
    grid chunks of ``index``, as ``plan.boxes.Share``'s fields (shape, copies, elements, read elements);
    None when the chunks are no grid or the tensor has no dimension."""
    grid = index.grid
    if grid is None or not index.ndim:
        return None
    cuts_lists, cells_list = grid
    at = [f for f, box in enumerate(dst) if box is not None]
    if not at:
        return {}
    boxes = np.array([[side for interval in dst[f] or () for side in interval] for f in at], dtype=np.int64)
    lo, hi = boxes[:, 0::2], boxes[:, 1::2]
    ndim = index.ndim
    cuts = [np.array(c, dtype=np.int64) for c in cuts_lists]
    first = np.stack([np.searchsorted(cuts[d], lo[:, d], "right") - 1 for d in range(ndim)], axis=1)
    last = np.stack([np.searchsorted(cuts[d], hi[:, d], "left") for d in range(ndim)], axis=1)
    spans = np.where((hi > lo).all(axis=1, keepdims=True), np.maximum(last - first, 0), 0)
    counts = spans.prod(axis=1)
    owner = np.repeat(np.arange(len(at)), counts)  # the box each piece belongs to, pieces in order
    local = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    cut = np.empty((len(owner), ndim), dtype=np.int64)
    for d in range(ndim - 1, -1, -1):  # unravel: the last dimension varies fastest (itertools.product)
        span = spans[owner, d]
        cut[:, d] = first[owner, d] + local % np.maximum(span, 1)
        local //= np.maximum(span, 1)
    cell_lo = np.stack([cuts[d][cut[:, d]] for d in range(ndim)], axis=1)
    cell_hi = np.stack([cuts[d][cut[:, d] + 1] for d in range(ndim)], axis=1)
    piece_lo, piece_hi = np.maximum(lo[owner], cell_lo), np.minimum(hi[owner], cell_hi)
    strides = [int(np.prod([len(c) - 1 for c in cuts_lists[d + 1 :]], dtype=np.int64)) for d in range(ndim)]
    cell = (cut * np.array(strides, dtype=np.int64)).sum(axis=1)
    chunk = np.array(index.used, dtype=np.int64)[np.array(cells_list, dtype=np.int64)[cell]]
    lengths = piece_hi - piece_lo
    whole = (lengths == cell_hi - cell_lo).all(axis=1)
    return _shares(at, counts, lo, hi, chunk, piece_lo - cell_lo, piece_lo - lo[owner], lengths, whole)


class GridCopies(Sequence[RelativeCopy]):
    """One share's copies as slices of its class's columns: counted and read chunk by chunk without a
    tuple per copy (planning), built as the plain tuples when first indexed or iterated (writing,
    validating). Compares, hashes and pickles as that tuple."""

    def __init__(self, columns: tuple[np.ndarray, ...], start: int, stop: int) -> None:
        self._columns = columns  # chunk, src start, dst start, lengths, whole: one row per copy of the class
        self._start, self._stop = start, stop
        self._built: tuple[RelativeCopy, ...] | None = None

    def __len__(self) -> int:
        return self._stop - self._start

    def chunks(self) -> list[int]:
        """The chunk each copy reads, in order (no copy built)."""
        return self._columns[0][self._start : self._stop].tolist()

    def built(self) -> tuple[RelativeCopy, ...]:
        if self._built is None:
            chunk, src, dst, lengths, whole = (c[self._start : self._stop].tolist() for c in self._columns)
            rows = zip(chunk, map(tuple, src), map(tuple, dst), map(tuple, lengths), whole, strict=True)
            self._built = tuple(rows)
        return self._built

    @overload
    def __getitem__(self, index: int) -> RelativeCopy: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[RelativeCopy, ...]: ...
    def __getitem__(self, index: int | slice) -> RelativeCopy | tuple[RelativeCopy, ...]:
        return self.built()[index]

    def __iter__(self) -> Iterator[RelativeCopy]:
        return iter(self.built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.built() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.built())

    def __reduce__(self) -> tuple[type, tuple[tuple[RelativeCopy, ...]]]:
        return tuple, (self.built(),)


def _shares(
    at: list[int],
    counts: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    chunk: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    lengths: np.ndarray,
    whole: np.ndarray,
) -> dict[int, ShareParts]:
    """The pieces (in order, ``counts`` per box) as shares whose copies are built when first used."""
    columns = (chunk, src, dst, lengths, whole)
    ends = np.cumsum(counts)
    running = np.concatenate(([0], np.cumsum(lengths.prod(axis=1))))
    read = running[ends] - running[ends - counts]  # the elements each box's pieces read
    shapes = (hi - lo).tolist()
    out: dict[int, ShareParts] = {}
    for j, (f, end, n) in enumerate(zip(at, ends.tolist(), counts.tolist(), strict=True)):
        shape = tuple(shapes[j])
        out[f] = (shape, GridCopies(columns, end - n, end), math.prod(shape), int(read[j]))
    return out


__all__ = ["GridCopies", "RelativeCopy", "ShareParts", "grid_index", "grid_shares"]
