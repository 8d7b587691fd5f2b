"""A DCP output's chunks as columns, one table per chunking: what ``ops.chunked.boxed_dcp`` plans with.

A DCP checkpoint of 5 000 parameters on 1 024 ranks has 5 M output chunks, and its ``.metadata``
needs every one's box, data file, byte offset and archive length. Built as one ``Chunk`` record and
one ``dcp.archive_size`` call per chunk (``plan.dcp.chunks_metadata``), that was some 5 us a chunk.
But the tensors of a checkpoint share a few chunkings (one per shape: ``even_boxes`` and a
strategy's layouts cut every tensor of one shape alike), so:

* **One ``Placed`` per chunking** (``Placements``): the data-file ranks of its chunks, ascending (the
  order torch's ``.metadata`` lists a tensor's chunks in, file by file), their boxes, and the
  offsets and sizes as int64 columns, made once and shared, read-only, by every tensor cut alike;
  its archive lengths once per dtype (``dcp.archive_size`` of each distinct chunk size only) and its
  tiling checked once (``dcp.check_chunks`` depends on the shape and boxes alone).
* **Per tensor, two array operations** (``metadata_columns``): each data file's write position is a
  column of running totals, so a tensor's byte offsets are that column at its files' ranks, and the
  column then grows by its archive lengths. Each tensor's ``TensorMeta`` holds a ``ChunkTable``
  whose only column of its own is those offsets (8 bytes a chunk).

The result is the same ``.metadata`` as ``chunks_metadata`` makes from records (byte for byte,
``tests/test_dcp_columns.py``), pickled only when written (``plan.dcp.DeferredText``).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from reshard import dtypes
from reshard.formats import dcp
from reshard.layout import Box, layout_map
from reshard.layout.chunks import whole_box
from reshard.plan.dcp import Chunking, DeferredText, EvenRows, StrategyBoxes, data_file_name, placements
from reshard.plan.model import TensorPlan, TextOutput


@dataclass(eq=False)
class Placed:
    """One chunking of one shape: the chunks' data-file ranks (ascending, each once) and boxes as columns.

    ``cells``: the boxes aligned to a run's data files (``Placements.cells``); ``lengths``: the archive
    length of each chunk per dtype; ``checked``: its tiling checked."""

    ranks: tuple[int, ...]
    boxes: tuple[Box, ...]
    offsets: np.ndarray  # (n, ndim) int64
    sizes: np.ndarray  # (n, ndim) int64
    files: tuple[str, ...]  # data_file_name of each rank
    file_ids: np.ndarray  # (n,) int32: 0..n-1
    lengths: dict[dtypes.DType, np.ndarray] = field(default_factory=dict)
    cells: tuple[Box | None, ...] | None = None
    columns: np.ndarray | None = None  # each chunk's data file among a run's (``Placements.columns``)
    checked: bool = False

    def archive_lengths(self, dtype: dtypes.DType) -> np.ndarray:
        """Each chunk's archive length (``dcp.archive_size``) as an int64 column, made once per dtype."""
        hit = self.lengths.get(dtype)
        if hit is None:
            distinct, inverse = np.unique(self.sizes, axis=0, return_inverse=True)
            each = np.array([dcp.archive_size(dtype, row) for row in distinct.tolist()], dtype=np.int64)
            hit = self.lengths[dtype] = each[inverse.reshape(-1)]
            hit.setflags(write=False)
        return hit


def _placed(where: Sequence[tuple[int, Box]], ndim: int) -> Placed | None:
    """The chunking ``where`` (rank, box) as columns, by rank; None when two chunks share a data file."""
    ordered = sorted(where, key=lambda placed: placed[0])
    ranks = tuple(r for r, _ in ordered)
    if len(set(ranks)) != len(ranks):
        return None
    boxes = tuple(b for _, b in ordered)
    flat = np.array([[a for a, _ in b] + [z - a for a, z in b] for b in boxes], dtype=np.int64)
    flat = flat.reshape(len(boxes), 2 * ndim)
    offsets, sizes = np.ascontiguousarray(flat[:, :ndim]), np.ascontiguousarray(flat[:, ndim:])
    file_ids = np.arange(len(ranks), dtype=np.int32)
    for column in (offsets, sizes, file_ids):
        column.setflags(write=False)
    return Placed(ranks, boxes, offsets, sizes, tuple(data_file_name(r) for r in ranks), file_ids)


class Placements:
    """The ``Placed`` chunking of every tensor of one DCP output, made once per distinct chunking.

    The key says what the chunking depends on: the shape (and, for ``EvenRows``, the tensor's row
    grain; for ``StrategyBoxes``, its layout and lowest pipeline stage), never the tensor's name."""

    def __init__(self, how: Chunking) -> None:
        self.how = how
        self._lmap = layout_map(how.table) if isinstance(how, StrategyBoxes) else None
        self._by_key: dict[Hashable, Placed | None] = {}
        self._ranks: list[int] | None = None

    def _key(self, t: TensorPlan) -> Hashable:
        if isinstance(self.how, EvenRows):
            return (t.shape, self.how.grains.get(t.name, 1))
        assert self._lmap is not None
        staged = self._lmap.get(t.name)
        return (t.shape,) if staged is None else (t.shape, staged.layout, min(staged.stages))

    def of(self, t: TensorPlan) -> Placed | None:
        """Where the chunks of full tensor ``t`` go (None: two of them in one data file)."""
        key = self._key(t)
        if key in self._by_key:
            return self._by_key[key]
        where = placements(t, self.how, ()) or [(0, whole_box(t.shape))]  # an empty tensor: one chunk
        placed = self._by_key[key] = _placed(where, len(t.shape))
        return placed

    def ranks(self) -> list[int]:
        """Every data file's rank, ascending (each chunking's cells and columns are then fixed)."""
        if self._ranks is None:
            chosen = [p for p in self._by_key.values() if p is not None]
            self._ranks = sorted({r for p in chosen for r in p.ranks})
            column = {r: j for j, r in enumerate(self._ranks)}
            for p in chosen:
                cells: list[Box | None] = [None] * len(self._ranks)
                for r, box in zip(p.ranks, p.boxes, strict=True):
                    cells[column[r]] = box
                p.cells = tuple(cells)
                p.columns = np.array([column[r] for r in p.ranks], dtype=np.intp)
        return self._ranks


def metadata_columns(
    placed: Iterable[tuple[str, dtypes.DType, tuple[int, ...], Placed]],
    ranks: Sequence[int],
    folder: str,
    byte_items: Sequence[dcp.BytesItem] = (),
) -> TextOutput:
    """The ``.metadata`` of tensors (fqn, dtype, shape, chunking) written in this order into the data
    files of ``ranks`` (``Placements.ranks``): each chunk's archive starts where its file's previous
    one ends; the tensors listed by first appearance (file by file). Each chunking is checked once;
    the pickle is made when written (``DeferredText``)."""
    position = np.zeros(len(ranks), dtype=np.int64)
    tensors, first = [], []
    for fqn, dtype, shape, p in placed:
        assert p.columns is not None, "Placements.ranks() fixes the columns first"
        lengths = p.archive_lengths(dtype)
        starts = position[p.columns]
        position[p.columns] += lengths
        table = dcp.ChunkTable(p.offsets, p.sizes, p.files, p.file_ids, starts, lengths)
        tensor = dcp.TensorMeta(fqn, dtype, shape, table)
        if not p.checked:
            dcp.check_chunks(tensor)  # the boxes tile the shape: the same for every tensor cut alike
            p.checked = True
        tensors.append(tensor)
        first.append(int(p.columns[0]))
    # listed as torch lists them, by first appearance: file by file, each file's tensors in order
    order = sorted(range(len(tensors)), key=first.__getitem__)
    tensors = [tensors[k] for k in order]
    items = tuple(byte_items)
    return DeferredText(os.path.join(folder, dcp.METADATA_NAME), lambda: dcp.metadata_pickle(tensors, items))


__all__ = ["Placed", "Placements", "metadata_columns"]
