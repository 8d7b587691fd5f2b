"""A plan of full tensors re-cut as a PyTorch DCP checkpoint: chunks in ``__<r>_0.distcp`` files, ``.metadata`` last.

Why from a plan of full tensors: every operation already plans its full tensors through the one
tensor pipeline (filters, dequantize, casts, model maps), and a full tensor's copies say which box
of it each source tensor supplies. A DCP checkpoint needs no full tensor: each chunk is a box of
its global tensor, so the copies are only regrouped, never merged — the plan reads and writes
each byte once, whatever the chunking. Three chunkings (``Chunking``):

* ``SourceSlices``: each copy is a chunk, in the data file of the source rank it reads (rank
  folders: each distinct rank slice, read from the lowest rank holding it, becomes one chunk of
  ``__<that rank>_0.distcp``; one full file: one chunk per tensor in ``__0_0.distcp``);
* ``EvenRows(n)``: dim 0 cut into ``n`` parts as ``torch.chunk`` / DTensor ``Shard(0)`` does
  (``layout.chunks.even_boxes``; empty trailing parts hold no chunk), part ``k`` in ``__k_0``;
* ``StrategyBoxes(table)``: each distinct rank box of a MindSpore strategy, in the file of the
  lowest (global) rank holding it.

The data files are ``FilePlan`` s of format ``"distcp"`` (``formats.distcp_format``) whose tensors
are named ``dcp.chunk_name(fqn, offsets)``; since the archive layout depends only on each chunk's
dtype and sizes, the ``.metadata`` pickle (every chunk's file, offset and length) is computed here,
before any byte is written, and is the plan's last output (a ``TextOutput`` of bytes), written
after every data file: a checkpoint interrupted earlier has no ``.metadata``, as torch's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reshard import dtypes
from reshard.errors import UnsupportedError
from reshard.formats import dcp
from reshard.formats.distcp_format import NAME as DISTCP
from reshard.layout import Box, LayoutTable, device_num, layout_map
from reshard.layout.chunks import box_shape, even_boxes, intersect, layout_chunks, whole_box
from reshard.plan.model import Copy, FilePlan, Plan, TensorPlan, TextOutput

Placement = tuple[int, Box]  # (data file rank, box of the global tensor)


def data_file_name(rank: int) -> str:
    """The data file torch's ``FileSystemWriter`` names for rank ``rank``'s first (only) file."""
    return f"__{rank}_0{dcp.DATA_SUFFIX}"


@dataclass(frozen=True)
class SourceSlices:
    """Each copy of a full tensor is a chunk, in the file of the source rank it reads (see the module)."""


@dataclass(frozen=True)
class EvenRows:
    """Dim 0 cut into ``parts`` like ``torch.chunk`` (0-dim and empty tensors: whole, in rank 0).

    ``grains``: tensors whose rows are cut in whole groups (an FP8 weight: its block rows, so that each
    part holds the blocks its scale's part scales; ``plan.quantized_dcp``)."""

    parts: int
    grains: Mapping[str, int] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class StrategyBoxes:
    """Each distinct rank box of a strategy's layout, in the lowest global rank holding it."""

    table: LayoutTable


Chunking = SourceSlices | EvenRows | StrategyBoxes

_RANK_FOLDER = re.compile(r"rank_?(\d+)$")


def source_ranks(sources: Sequence[str]) -> list[int]:
    """Each source file's rank: its ``rank_<r>`` folder's number when every file has a distinct one, else
    its position in the plan's sources."""
    found = [_RANK_FOLDER.search(os.path.basename(os.path.dirname(os.path.abspath(p)))) for p in sources]
    ranks = [int(m.group(1)) for m in found if m is not None]
    if len(ranks) == len(sources) and len(set(ranks)) == len(ranks):
        return ranks
    return list(range(len(sources)))


def _held(c: Copy) -> Box:
    """The box of the destination tensor a copy fills."""
    return tuple((d, d + n) for d, n in zip(c.dst_start, c.lengths, strict=True))


def cut(t: TensorPlan, box: Box, name: str) -> TensorPlan:
    """The part of full tensor ``t`` in ``box``, as tensor ``name``: its copies cut to the box."""
    origin = tuple(a for a, _ in box)
    copies = []
    for c in t.copies:
        piece = intersect(_held(c), box) if box else ()
        if piece is None or (box and any(a >= b for a, b in piece)):
            continue
        lengths = box_shape(piece)
        src = list(c.src_start)
        for j, (a, _) in enumerate(piece):
            src[c.src_perm[j] if c.src_perm is not None else j] += a - c.dst_start[j]
        start = tuple(a - o for (a, _), o in zip(piece, origin, strict=True))
        whole = c.whole_source and lengths == c.lengths
        copies.append(Copy(c.source, c.tensor, tuple(src), start, lengths, whole, c.src_view, c.src_perm))
    shape = box_shape(box)
    return TensorPlan(name, t.dtype, shape, tuple(copies), math.prod(shape) * t.dtype.itemsize)


def placements(t: TensorPlan, chunking: Chunking, ranks: Sequence[int]) -> list[Placement]:
    """Where the chunks of full tensor ``t`` go."""
    if isinstance(chunking, SourceSlices):
        return [(ranks[c.source], _held(c)) for c in t.copies]
    if isinstance(chunking, EvenRows):
        if not t.shape or t.shape[0] == 0:
            return [(0, whole_box(t.shape))]
        boxes = even_boxes(t.shape, 0, chunking.parts, chunking.grains.get(t.name, 1))
        return [(k, b) for k, b in enumerate(boxes) if b[0][0] < b[0][1]]
    return _strategy_placements(t, chunking.table)


def _strategy_placements(t: TensorPlan, table: LayoutTable) -> list[Placement]:
    lmap = layout_map(table)
    staged = lmap.get(t.name)
    if staged is None:  # in no layout (global_step): whole, in rank 0
        return [(0, whole_box(t.shape))]
    n = device_num(table, lmap)
    stage = min(staged.stages)
    chunks = layout_chunks(t.name, staged.layout, t.shape, t.dtype, {r: str(r) for r in range(n)})
    return [(stage * n + int(f), b) for b, f in zip(chunks.boxes, chunks.files, strict=True)]


def dcp_plan(
    full: Plan,
    folder: str,
    chunking: Chunking,
    notes: list[str] | None = None,
    byte_items: Sequence[dcp.BytesItem] = (),
) -> Plan:
    """``full`` (a plan of full tensors, any files) re-cut as a DCP checkpoint in ``folder``.

    Strings (MindSpore's string entries) have no DCP tensor form: passed over, with a note.
    ``byte_items``: non-tensor values the ``.metadata`` also lists (their file is the caller's to write).

    Raises:
        UsageError: A dtype PyTorch has none of (int4).
        LayoutError: A strategy that does not fit a tensor (``StrategyBoxes``).
    """
    ranks = source_ranks(full.sources)
    by_rank: dict[int, list[TensorPlan]] = {}
    shapes: dict[str, tuple[dtypes.DType, tuple[int, ...]]] = {}
    strings = []
    for t in (t for f in full.files for t in f.tensors):
        if t.literal is not None or t.dtype is dtypes.STR:
            strings.append(t.name)
            continue
        dtypes.torch_name(t.dtype)
        shapes[t.name] = (t.dtype, t.shape)
        for rank, box in placements(t, chunking, ranks) or [(0, whole_box(t.shape))]:  # an empty tensor: one chunk
            by_rank.setdefault(rank, []).append(cut(t, box, dcp.chunk_name(t.name, tuple(a for a, _ in box))))
    if strings and notes is not None:
        listed = ", ".join(strings)
        notes.append(f"passed over {len(strings)} string entries (a DCP checkpoint holds tensors): {listed}")
    if not shapes:
        raise UnsupportedError("no tensor to write as a DCP checkpoint", folder)
    files = tuple(
        FilePlan(os.path.join(folder, data_file_name(r)), DISTCP, tuple(by_rank[r]), rank=r) for r in sorted(by_rank)
    )
    metadata = metadata_output(files, folder, shapes, byte_items)
    return Plan(full.operation, full.sources, files, (metadata,), full.quantized)


def metadata_output(
    files: Sequence[FilePlan],
    folder: str,
    shapes: dict[str, tuple[dtypes.DType, tuple[int, ...]]],
    byte_items: Sequence[dcp.BytesItem] = (),
) -> TextOutput:
    """The ``.metadata`` of the data files ``files`` (laid out as the executor will lay them out)."""
    from reshard.formats.base import TensorSpec
    from reshard.formats.distcp_format import chunk_spec

    placed = []
    for f in files:
        specs = (chunk_spec(TensorSpec(t.name, t.dtype, t.shape, t.nbytes)) for t in f.tensors)
        placed.append((f.path, [(s.fqn, s.dtype, s.offsets, s.sizes) for s in specs]))
    return chunks_metadata(placed, folder, shapes, byte_items)


ChunkPlace = tuple[str, dtypes.DType, tuple[int, ...], tuple[int, ...]]  # fqn, dtype, offsets, sizes


class DeferredText(TextOutput):
    """A text output whose bytes are made when first read: the ``.metadata`` of a checkpoint of millions
    of chunks is pickled when the run writes it (after every data file), not while ``reshard plan``
    prints the plan. Made once; compared, hashed and pickled (Ray) as the plain ``TextOutput`` it is."""

    _make: Callable[[], bytes]
    _made: bytes | None

    def __init__(self, path: str, make: Callable[[], bytes]) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_made", None)

    @property
    def text(self) -> bytes:
        made: bytes | None = self._made
        if made is None:
            made = self._make()
            object.__setattr__(self, "_made", made)
        return made

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TextOutput):
            return (self.path, self.text) == (other.path, other.text)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.path, self.text))

    def __reduce__(self) -> tuple[type, tuple[str, bytes]]:
        return TextOutput, (self.path, self.text)


def chunks_metadata(
    files: Iterable[tuple[str, Sequence[ChunkPlace]]],
    folder: str,
    shapes: dict[str, tuple[dtypes.DType, tuple[int, ...]]],
    byte_items: Sequence[dcp.BytesItem] = (),
) -> TextOutput:
    """The ``.metadata`` of data files (path, chunks in file order): each chunk's archive starts where the
    previous one ends (``dcp.archive_size``, what ``dcp.distcp_layout`` lays out, without its framing),
    and of the non-tensor values ``byte_items`` (in a file the caller writes). The chunks are checked
    now; the pickle is made when written (``DeferredText``)."""
    gathered: dict[str, list[dcp.Chunk]] = {}
    for path, chunks in files:
        rel, pos = os.path.basename(path), 0
        for fqn, dtype, offsets, sizes in chunks:
            size = dcp.archive_size(dtype, sizes)
            gathered.setdefault(fqn, []).append(dcp.Chunk(fqn, offsets, sizes, rel, pos, size))
            pos += size
    tensors = [dcp.TensorMeta(fqn, *shapes[fqn], tuple(chunks)) for fqn, chunks in gathered.items()]
    for tensor in tensors:
        dcp.check_chunks(tensor)
    items = tuple(byte_items)
    return DeferredText(os.path.join(folder, dcp.METADATA_NAME), lambda: dcp.metadata_pickle(tensors, items))


__all__ = [
    "ChunkPlace",
    "Chunking",
    "DeferredText",
    "EvenRows",
    "Placement",
    "SourceSlices",
    "StrategyBoxes",
    "chunks_metadata",
    "cut",
    "data_file_name",
    "dcp_plan",
    "metadata_output",
    "placements",
    "source_ranks",
]
