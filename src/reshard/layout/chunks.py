"""Chunk boxes: every source tensor as boxes of its global tensor, the planning input of any format.

A MindSpore layout says which box of the full tensor each rank holds, but only for splits that
divide the shape (``algebra.slice_shape``). PyTorch's checkpoints do not divide: DCP stores
arbitrary boxes (``torch.chunk`` shards whose last one is short, several chunks of one tensor in
one file, a grid of uneven tensor-parallel x FSDP blocks). So the common input of planning is the
most general one: a tensor is a list of boxes of its global tensor, each held (C order, dense) by
one tensor of one file, and a destination is a box of each tensor per output file. Every kind of
source compiles to it here: MindSpore layouts (``layout_chunks``), Checkpoint 2.0's slice grid
(``grid_chunks``), a full file (``whole_chunks``); destinations are boxes too (``even_boxes`` for
``torch.chunk`` / DTensor ``Shard`` splits, ``grid_boxes`` for uneven grids, ``algebra.rank_boxes``
for MindSpore layouts). ``reshard.plan.boxes`` plans from them.

Why it is built this way:

* **Columns, not objects.** A ``ChunkedTensor`` keeps its chunks as parallel tuples (boxes,
  files, tensor names), so tensors with the same chunking share them: a 4 096-rank checkpoint of
  5 000 parameters is a handful of box tuples and one tuple of file paths, not 20 million objects.
  ``Chunk`` is the one-chunk view, for callers that build chunks one by one (``of_chunks``).
* **Checked once per chunking.** ``ChunkIndex`` checks that the boxes tile the tensor: no box
  outside it, no two boxes that overlap without being the same box (identical boxes are replicas:
  the first is used), no element in no box. A bad chunking is a ``LayoutError`` naming the tensor
  and the files, before any plan exists.
* **Intersections in O(pieces).** Chunks that form a grid (the cut points of every dimension, with
  one chunk per cell: every MindSpore layout, every DTensor placement, uneven ones included) are
  intersected by bisecting each dimension's cuts; any other tiling by bisecting the first
  dimension's starts (within the longest chunk's reach). Pieces come in row-major order of the
  chunks' starts, the order in which ``transfer.transfer_pieces`` lists a grid's slices.
* **Pure.** Plain ints and tuples, like the rest of this layer: no numpy, no file.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reshard.dtypes import DType
from reshard.errors import LayoutError, UsageError
from reshard.layout.algebra import Box, rank_boxes
from reshard.layout.types import ParamLayout

Piece = tuple[int, Box]  # (index of the chunk in its tensor's columns, box of the global tensor)


@dataclass(frozen=True)
class Chunk:
    """One box of a global tensor, held C-order and dense by tensor ``tensor`` of ``file``."""

    box: Box
    file: str
    tensor: str

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)


@dataclass(frozen=True)
class ChunkedTensor:
    """A global tensor (``name``, ``shape``, ``dtype``) and the chunks holding it, as columns.

    Chunk ``i`` is box ``boxes[i]``, held by tensor ``tensors[i]`` of file ``files[i]``
    (``tensors=None``: by a tensor named ``name`` in every file). Several chunks may share a file.
    """

    name: str
    shape: tuple[int, ...]
    dtype: DType
    boxes: tuple[Box, ...]
    files: tuple[str, ...]
    tensors: Sequence[str] | None = None  # a tuple, or a lazy sequence (a DCP folder's chunk names)

    def __post_init__(self) -> None:
        if len(self.files) != len(self.boxes) or (self.tensors is not None and len(self.tensors) != len(self.boxes)):
            raise UsageError(
                f"tensor {self.name!r}: {len(self.boxes)} chunk boxes but {len(self.files)} files"
                + (f" and {len(self.tensors)} tensor names" if self.tensors is not None else "")
            )

    def tensor_of(self, i: int) -> str:
        """The name, inside its file, of the tensor holding chunk ``i``."""
        return self.name if self.tensors is None else self.tensors[i]

    def chunk(self, i: int) -> Chunk:
        return Chunk(self.boxes[i], self.files[i], self.tensor_of(i))

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(self.chunk(i) for i in range(len(self.boxes)))

    @staticmethod
    def of_chunks(name: str, shape: Sequence[int], dtype: DType, chunks: Sequence[Chunk]) -> ChunkedTensor:
        """The tensor from ``Chunk`` objects (one by one, as a reader meets them)."""
        tensors = tuple(c.tensor for c in chunks)
        return ChunkedTensor(
            name,
            tuple(shape),
            dtype,
            tuple(c.box for c in chunks),
            tuple(c.file for c in chunks),
            None if all(t == name for t in tensors) else tensors,
        )


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def whole_box(shape: Sequence[int]) -> Box:
    """The box of the whole tensor."""
    return tuple((0, d) for d in shape)


def box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b`` (None: they share no element)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# the index: coverage checks and intersections


class ChunkIndex:
    """The chunks of one (shape, boxes), checked to tile the tensor, and their intersections.

    ``tensor`` names the tensor (and its files) in error messages; the index itself depends only
    on the shape and the boxes, so tensors sharing a chunking share one index.
    """

    def __init__(self, tensor: ChunkedTensor) -> None:
        self.shape = tensor.shape
        self.ndim = len(tensor.shape)
        kept = _distinct(tensor)
        self.used = tuple(sorted(kept, key=lambda i: tuple(a for a, _ in tensor.boxes[i])))
        self.boxes = tuple(tensor.boxes[i] for i in self.used)
        self._grid = _grid_cells(self.shape, self.boxes)
        if self._grid is None:
            _check_tiling(tensor, self.used)
            self._starts = [b[0][0] for b in self.boxes] if self.ndim else []
            self._reach = max((b[0][1] - b[0][0] for b in self.boxes), default=0) if self.ndim else 0

    @classmethod
    def of_grid(cls, tensor: ChunkedTensor, used: Sequence[int], cuts: list[list[int]], cells: list[int]) -> ChunkIndex:
        """The index of chunks found elsewhere to be a grid (``plan.box_shares.grid_index``, on columns):
        ``used`` the chunks read (the first of each distinct non-empty box, by start), the grid's cuts
        and the position in ``used`` of each row-major cell's chunk; what ``__init__`` would find."""
        index = cls.__new__(cls)
        index.shape = tensor.shape
        index.ndim = len(tensor.shape)
        index.used = tuple(used)
        index.boxes = tuple(tensor.boxes[i] for i in index.used)
        index._grid = (cuts, cells)
        return index

    @property
    def is_grid(self) -> bool:
        return self._grid is not None

    @property
    def grid(self) -> tuple[list[list[int]], list[int]] | None:
        """(each dimension's sorted cuts, the position in ``used`` of each row-major cell's chunk) when
        the chunks form a grid, else None (what a caller intersecting many boxes at once needs)."""
        return self._grid

    def pieces(self, box: Box) -> list[Piece]:
        """(chunk index, common box) of every chunk meeting ``box``, row-major by chunk start."""
        if any(a >= b for a, b in box):
            return []
        if self._grid is not None:
            return self._grid_pieces(box)
        if not self.ndim:
            return [(self.used[0], ())]
        lo0, hi0 = box[0]
        first = bisect.bisect_right(self._starts, lo0 - self._reach)
        last = bisect.bisect_left(self._starts, hi0)
        out = []
        for k in range(first, last):
            common = intersect(self.boxes[k], box)
            if common is not None:
                out.append((self.used[k], common))
        return out

    def _grid_pieces(self, box: Box) -> list[Piece]:
        cuts, cells = self._grid  # type: ignore[misc]
        per_dim = []
        for (lo, hi), dim_cuts in zip(box, cuts, strict=True):
            first = bisect.bisect_right(dim_cuts, lo) - 1
            last = bisect.bisect_left(dim_cuts, hi)
            per_dim.append([(i, (max(lo, dim_cuts[i]), min(hi, dim_cuts[i + 1]))) for i in range(first, last)])
        strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(self.ndim)]
        out = []
        for combo in itertools.product(*per_dim):
            cell = sum(i * s for (i, _), s in zip(combo, strides, strict=True))
            out.append((self.used[cells[cell]], tuple(iv for _, iv in combo)))
        return out


def _distinct(tensor: ChunkedTensor) -> list[int]:
    """Indexes of the first chunk of every distinct non-empty box; a box outside the tensor raises."""
    seen: set[Box] = set()
    kept = []
    shape = tensor.shape
    for i, box in enumerate(tensor.boxes):
        if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape, strict=False)):
            raise LayoutError(
                f"tensor {tensor.name!r} (shape {list(shape)}): chunk {box_text(box)} of "
                f"{_chunk_name(tensor, i)} lies outside the tensor"
            )
        if box in seen or any(a == b for a, b in box):
            continue  # a replica, or an empty chunk: nothing to read from it
        seen.add(box)
        kept.append(i)
    return kept


def _chunk_name(tensor: ChunkedTensor, i: int) -> str:
    inner = tensor.tensor_of(i)
    return tensor.files[i] if inner == tensor.name else f"{inner!r} in {tensor.files[i]}"


def _grid_cells(shape: tuple[int, ...], boxes: Sequence[Box]) -> tuple[list[list[int]], list[int]] | None:
    """(cuts per dim, chunk of each row-major cell) when the boxes are exactly the cells of a grid."""
    if not boxes:
        return None
    cuts = [sorted({v for b in boxes for v in b[d]} | {0, size}) for d, size in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        return None
    cells = [-1] * len(boxes)
    strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(len(shape))]
    for k, box in enumerate(boxes):
        cell = 0
        for (a, b), dim_cuts, stride in zip(box, cuts, strides, strict=True):
            i = bisect.bisect_left(dim_cuts, a)
            if dim_cuts[i + 1] != b:
                return None
            cell += i * stride
        if cells[cell] != -1:
            return None
        cells[cell] = k
    return cuts, cells


def _check_tiling(tensor: ChunkedTensor, used: Sequence[int]) -> None:
    """Distinct boxes that are not a grid: no two overlap, and together they hold every element."""
    boxes = [tensor.boxes[i] for i in used]
    overlap = _first_overlap(boxes)
    if overlap is not None:
        j, k = overlap
        raise LayoutError(
            f"tensor {tensor.name!r}: chunks {box_text(boxes[j])} of {_chunk_name(tensor, used[j])} and "
            f"{box_text(boxes[k])} of {_chunk_name(tensor, used[k])} overlap without being the same box"
        )
    held = sum(math.prod(box_shape(b)) for b in boxes)
    total = math.prod(tensor.shape)
    if held != total:
        raise LayoutError(
            f"tensor {tensor.name!r} (shape {list(tensor.shape)}): its chunks hold {held} of its {total} "
            "elements (a hole: some element is in no chunk)"
        )


def _first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """The first pair of overlapping boxes (sorted by their first dim's start), or None."""
    if not boxes or not boxes[0]:
        return None
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    for n, j in enumerate(order):
        stop0 = boxes[j][0][1]
        for k in order[n + 1 :]:
            if boxes[k][0][0] >= stop0:
                break
            if intersect(boxes[j], boxes[k]) is not None:
                return min(j, k), max(j, k)
    return None


# --------------------------------------------------------------------------------------------
# compilers: each kind of source to chunks


def whole_chunks(name: str, shape: Sequence[int], dtype: DType, file: str, tensor: str | None = None) -> ChunkedTensor:
    """A tensor held whole by one file (a full model, a Hugging Face shard): one chunk."""
    shape = tuple(shape)
    return ChunkedTensor(
        name, shape, dtype, (whole_box(shape),), (file,), None if tensor in (None, name) else (tensor,)
    )


def layout_chunks(
    name: str,
    p: ParamLayout | None,
    shape: Sequence[int],
    dtype: DType,
    holders: Mapping[int, str],
    tensor: str | None = None,
) -> ChunkedTensor:
    """A MindSpore-laid-out tensor: each distinct rank box once, from the lowest rank holding it.

    ``holders`` maps each rank whose file holds the tensor (named ``tensor``, default ``name``) to
    that file; a rank absent from it (a save without redundant copies) is passed over for a
    replica. Replicas are one pick for every destination, as the planners pick when device counts
    do not divide (``transfer_pieces(any_device_num=True)``'s lowest holder). When every box's
    lowest rank is a holder (the common case), the boxes are one tuple shared by every tensor of
    the same layout and shape, and the work is one step per distinct box, not per rank.
    """
    shape = tuple(shape)
    groups = _rank_groups(p, shape)
    tensors_of = None if tensor in (None, name) else tensor
    if all(ranks[0] in holders for ranks in groups.ranks):
        files = tuple(holders[ranks[0]] for ranks in groups.ranks)
        return ChunkedTensor(name, shape, dtype, groups.boxes, files, _same(tensors_of, len(files)))
    n = sum(len(ranks) for ranks in groups.ranks)
    outside = [r for r in holders if not 0 <= r < n]
    if outside:
        raise LayoutError(f"tensor {name!r}: rank {outside[0]} is outside the {n} devices of its layout")
    chosen = []
    for box, ranks in zip(groups.boxes, groups.ranks, strict=True):
        rank = next((r for r in ranks if r in holders), None)
        if rank is None:
            raise LayoutError(f"tensor {name!r}: no source file holds the slice of rank {ranks[0]}")
        chosen.append((rank, box))
    chosen.sort()
    files = tuple(holders[r] for r, _ in chosen)
    return ChunkedTensor(name, shape, dtype, tuple(b for _, b in chosen), files, _same(tensors_of, len(files)))


def _same(tensor: str | None, count: int) -> tuple[str, ...] | None:
    return None if tensor is None else (tensor,) * count


@dataclass(frozen=True)
class _RankGroups:
    """A layout's distinct boxes, by lowest rank, and the ranks holding each (ascending)."""

    boxes: tuple[Box, ...]
    ranks: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=4096)
def _rank_groups(p: ParamLayout | None, shape: tuple[int, ...]) -> _RankGroups:
    by_box: dict[Box, list[int]] = {}
    for rank, box in enumerate(rank_boxes(p, shape)):
        by_box.setdefault(box, []).append(rank)
    return _RankGroups(tuple(by_box), tuple(tuple(r) for r in by_box.values()))


def grid_chunks(
    name: str,
    shape: Sequence[int],
    dtype: DType,
    fragmentations: Sequence[int],
    homes: Mapping[int, tuple[str, str]],
) -> ChunkedTensor:
    """A tensor cut into an even grid of ``fragmentations`` blocks per dim, numbered row-major.

    Checkpoint 2.0's form (``axis_fragmentations`` and slice ids, docs/formats.md §10.2): ``homes``
    maps each slice id to (file, tensor name in it).
    """
    shape, frags = tuple(shape), tuple(fragmentations)
    if len(frags) != len(shape) or any(f < 1 or d % f for d, f in zip(shape, frags, strict=True)):
        raise LayoutError(f"tensor {name!r}: fragmentations {list(frags)} do not divide its shape {list(shape)}")
    cells = grid_boxes(shape, [[d // f] * f for d, f in zip(shape, frags, strict=True)])
    ids = sorted(homes)
    if ids != list(range(len(cells))):
        absent = sorted(set(range(len(cells))) - set(ids))
        what = f"slice {absent[0]} is held by no file" if absent else f"slice id {ids[-1]} is outside the grid"
        raise LayoutError(f"tensor {name!r}: {what} (grid {list(frags)})")
    return ChunkedTensor(name, shape, dtype, cells, tuple(homes[i][0] for i in ids), tuple(homes[i][1] for i in ids))


# --------------------------------------------------------------------------------------------
# destination chunkings


def even_boxes(shape: Sequence[int], dim: int, parts: int, grain: int = 1) -> tuple[Box, ...]:
    """``parts`` boxes splitting ``dim`` like ``torch.chunk`` / DTensor ``Shard(dim)``.

    Each holds ``ceil(size / parts)`` rows, the last ones fewer and, when the rows run out, none
    (an empty box: that part holds an empty tensor, as DTensor's trailing ranks do). ``grain``: the
    rows are cut in whole groups of that many (an FP8 weight's block rows: each part's scale rows are
    then its own), as ``torch.chunk`` cuts the groups, the last group maybe partial. Cached: equal
    arguments return the same tuple, which is what lets a planner treat the tensors that share it
    as one table (``reshard.plan.boxes``).
    """
    return _even_boxes(tuple(shape), dim, parts, grain)


@functools.lru_cache(maxsize=4096)
def _even_boxes(shape: tuple[int, ...], dim: int, parts: int, grain: int = 1) -> tuple[Box, ...]:
    if not 0 <= dim < len(shape) or parts < 1 or grain < 1:
        raise UsageError(f"cannot split dim {dim} of a tensor of shape {list(shape)} into {parts} parts")
    groups = -(-shape[dim] // grain)
    step = -(-groups // parts) * grain  # ceil(groups / parts) groups a part
    sizes = [max(0, min(step, shape[dim] - k * step)) for k in range(parts)]
    return grid_boxes(shape, [sizes if d == dim else [n] for d, n in enumerate(shape)])


def grid_boxes(shape: Sequence[int], sizes: Sequence[Sequence[int]]) -> tuple[Box, ...]:
    """The row-major cells of a grid cutting dim ``d`` into consecutive blocks of ``sizes[d]``."""
    shape = tuple(shape)
    if len(sizes) != len(shape) or any(sum(s) != n or any(v < 0 for v in s) for s, n in zip(sizes, shape, strict=True)):
        raise UsageError(f"block sizes {[list(s) for s in sizes]} do not add up to the shape {list(shape)}")
    per_dim = []
    for dim_sizes in sizes:
        starts = list(itertools.accumulate(dim_sizes, initial=0))
        per_dim.append([(a, b) for a, b in itertools.pairwise(starts)])
    return tuple(itertools.product(*per_dim))


__all__ = [
    "Chunk",
    "ChunkIndex",
    "ChunkedTensor",
    "Piece",
    "box_shape",
    "box_text",
    "even_boxes",
    "grid_boxes",
    "grid_chunks",
    "intersect",
    "layout_chunks",
    "whole_box",
    "whole_chunks",
]
