"""Plans from chunk boxes: any chunking of the sources into any chunking of the outputs.

The other planners start from MindSpore layouts. This one starts from what every format can say
(``reshard.layout.chunks``): each source tensor as boxes of its global tensor held by tensors of
files (uneven ``torch.chunk`` shards, DCP chunks, Checkpoint 2.0 slices, MindSpore ranks, whole
files), and each output file's box of each tensor. The plan is the intersection of the two: the
plain ``Plan`` of ``reshard.plan.model``, checked by ``reshard.plan.validate`` and run by every
executor. A new source kind hands its tensors here as ``ChunkedTensor`` s and never touches the
layout algebra.

It is built for 5 000 tensors x 4 096 source chunks x 1 024 outputs the way ``reshard.plan.bulk``
is built for transforms:

* **Classes.** Tensors sharing (shape, source boxes, destination boxes) share one ``BoxClass``:
  the checked ``ChunkIndex`` and, per output file, the copies relative to the chunk and the
  destination box (``Share``). Classes are looked up by the identity of the box tuples first
  (compilers and readers share them), then by value.
* **Lazy files.** An output's tensors are a ``BoxTensors`` sequence, built on access; totals are
  arithmetic over (class, dtype) groups shared by every file holding the same tensors.
* **Sources in first-use order** (file, then tensor, then copy), as every other planner interns
  them, computed per file from the distinct (class, file column) pairs, not per tensor.

``assembled_tensor`` is the one-tensor form (a full tensor of a unify, one rank's tensor), with
the same copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from reshard import dtypes
from reshard.errors import LayoutError, UnsupportedError, UsageError
from reshard.layout import Box, LayoutTable, ParamLayout, device_num, full_shape, layout_map, rank_boxes
from reshard.layout.chunks import ChunkedTensor, ChunkIndex, box_shape, layout_chunks, whole_chunks
from reshard.plan.bulk import BuiltFiles
from reshard.plan.model import (
    Copy,
    FilePlan,
    FileStats,
    LazyTensors,
    Plan,
    SourceFile,
    SourcePaths,
    TensorPlan,
    read_bytes,
)

RelativeCopy = tuple[
    int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool
]  # chunk, src/dst start, lengths, whole


@dataclass(frozen=True)
class OutputFile:
    """One output file of a box plan: where, in which format, with which metadata."""

    path: str
    format: str
    metadata: tuple[tuple[str, str], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Target:
    """One destination tensor: source tensor ``tensor``, its box in each output file (None: absent).

    ``boxes`` has one entry per output file; ``name`` is its name in the outputs (default:
    ``tensor``). Targets with the same chunking should share one ``boxes`` tuple (``even_boxes``
    and ``rank_boxes`` return shared ones): that is what makes planning them one table.
    """

    tensor: str
    boxes: tuple[Box | None, ...]
    name: str | None = None

    @property
    def out_name(self) -> str:
        return self.name if self.name is not None else self.tensor


@dataclass(frozen=True)
class Share:
    """One output box of one class: its shape and the copies filling it, relative to the chunks."""

    shape: tuple[int, ...]
    copies: Sequence[RelativeCopy]  # a tuple, or columns built on first use (plan.box_shares.GridCopies)
    elements: int
    read_elements: int

    def chunks(self) -> Iterable[int]:
        """The chunk each copy reads, in order (a share of columns says without building its copies)."""
        lazy = getattr(self.copies, "chunks", None)
        return lazy() if lazy is not None else (c[0] for c in self.copies)


def relative_share(
    index: ChunkIndex, chunk_boxes: Sequence[Box], box: Box, held: Sequence[tuple[int, ...]] | None = None
) -> Share:
    """The copies of ``box`` from the chunks of ``index`` (``chunk_boxes``: the tensor's boxes;
    ``held``: their shapes, when the caller has them)."""
    origin = tuple(a for a, _ in box)
    copies: list[RelativeCopy] = []
    for k, piece in index.pieces(box):
        chunk = chunk_boxes[k]
        lengths = tuple(b - a for a, b in piece)
        copies.append(
            (
                k,
                tuple(a - h for (a, _), (h, _) in zip(piece, chunk, strict=True)),
                tuple(a - o for (a, _), o in zip(piece, origin, strict=True)),
                lengths,
                lengths == (held[k] if held is not None else box_shape(chunk)),
            )
        )
    shape = box_shape(box)
    return Share(shape, tuple(copies), math.prod(shape), sum(math.prod(c[3]) for c in copies))


class BoxClass:
    """One (source chunking, destination chunking) of one shape: its shares, computed on demand."""

    def __init__(self, index: ChunkIndex, chunk_boxes: tuple[Box, ...], dst: tuple[Box | None, ...]) -> None:
        self.index = index
        self.chunk_boxes = chunk_boxes
        self._held: tuple[tuple[int, ...], ...] | None = None
        self.dst = dst
        self._shares: dict[int, Share] = {}
        self._batched = False

    @property
    def held(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each chunk's tensor (made when first asked: shares of a grid need none)."""
        if self._held is None:
            self._held = tuple(box_shape(b) for b in self.chunk_boxes)
        return self._held

    def share(self, f: int) -> Share:
        hit = self._shares.get(f)
        if hit is None and not self._batched and len(self.dst) > 1:
            from reshard.plan.box_shares import grid_shares  # numpy: loaded with the first shares

            self._batched = True  # every output's share at once when the chunks form a grid
            found = grid_shares(self.index, self.dst) or {}
            self._shares.update((at, Share(*parts)) for at, parts in found.items())
            hit = self._shares.get(f)
        if hit is None:
            box = self.dst[f]
            if box is None:
                raise UsageError(f"output {f} holds no box of this tensor")
            hit = self._shares[f] = relative_share(self.index, self.chunk_boxes, box, self.held)
        return hit


class Indexes:
    """The checked ``ChunkIndex`` of every chunking of one planning run, by identity first, then value.

    Tensors of one layout and shape share their boxes tuple (``layout_chunks``, ``even_boxes``), so
    a run of thousands of tensors builds a handful of indexes, each looked up in one step.
    """

    def __init__(self) -> None:
        self._by_id: dict[tuple[int, tuple[int, ...]], tuple[tuple[Box, ...], ChunkIndex]] = {}
        self._by_value: dict[tuple[tuple[Box, ...], tuple[int, ...]], ChunkIndex] = {}

    def of(self, tensor: ChunkedTensor) -> ChunkIndex:
        hit = self._by_id.get((id(tensor.boxes), tensor.shape))
        if hit is None:
            index = self._by_value.get((tensor.boxes, tensor.shape))
            if index is None:
                index = self._by_value[(tensor.boxes, tensor.shape)] = _index(tensor)
            hit = self._by_id[(id(tensor.boxes), tensor.shape)] = (tensor.boxes, index)
        return hit[1]


_COLUMNS_FROM = 256  # chunks from which a chunking is indexed on numpy columns first (plan.box_shares)


def _index(tensor: ChunkedTensor) -> ChunkIndex:
    """``ChunkIndex(tensor)``; for many chunks forming a grid, found on columns (the same index)."""
    if len(tensor.boxes) >= _COLUMNS_FROM:
        from reshard.plan.box_shares import grid_index

        found = grid_index(tensor)
        if found is not None:
            return found
    return ChunkIndex(tensor)


class _Classes:
    """The classes of one planning run, by identity first, then by value."""

    def __init__(self) -> None:
        self.indexes = Indexes()
        self._by_id: dict[tuple[int, int], tuple[object, BoxClass]] = {}
        self._classes: dict[tuple[int, tuple[Box | None, ...]], BoxClass] = {}

    def get(self, tensor: ChunkedTensor, dst: tuple[Box | None, ...]) -> BoxClass:
        index = self.indexes.of(tensor)
        hit = self._by_id.get((id(index), id(dst)))
        if hit is None:
            cls = self._classes.get((id(index), dst))
            if cls is None:
                _check_boxes(tensor, dst)
                cls = self._classes[(id(index), dst)] = BoxClass(index, tensor.boxes, dst)
            hit = self._by_id[(id(index), id(dst))] = (dst, cls)
        return hit[1]


def _check_boxes(tensor: ChunkedTensor, dst: Sequence[Box | None]) -> None:
    """Every destination box lies inside the tensor."""
    for f, box in enumerate(dst):
        if box is not None and (
            len(box) != len(tensor.shape)
            or any(not 0 <= a <= b <= d for (a, b), d in zip(box, tensor.shape, strict=True))
        ):
            raise UsageError(
                f"tensor {tensor.name!r} (shape {list(tensor.shape)}): output {f}'s box "
                f"{[list(b) for b in box]} lies outside the tensor"
            )


@dataclass
class _Member:
    """One target as planned: its class, source tensor and output name."""

    cls: BoxClass
    source: ChunkedTensor
    name: str


class _Layout:
    """What every output file holding the same targets in the same order shares."""

    def __init__(self, members: tuple[_Member, ...]) -> None:
        self.members = members
        groups: dict[tuple[int, int], list] = {}
        pairs: dict[tuple[int, int], tuple[BoxClass, ChunkedTensor]] = {}
        for m in members:
            key = (id(m.cls), id(m.source.dtype))
            group = groups.get(key)
            if group is None:
                groups[key] = [m.cls, 1, m.source.dtype]
            else:
                group[1] += 1
            # (class, file column): a later member with the same pair reads no new file.
            pairs.setdefault((id(m.cls), id(m.source.files)), (m.cls, m.source))
        self.groups = tuple((cls, n, dtype) for cls, n, dtype in groups.values())
        self.pairs = tuple(pairs.values())

    def paths(self, f: int) -> Iterable[str]:
        """The source paths output ``f`` reads, in first-use order (repeats included)."""
        for cls, source in self.pairs:
            files = source.files
            for k in cls.share(f).chunks():
                yield files[k]


class BoxTensors(LazyTensors):
    """The tensors of one box-plan output, built on access from the shared classes."""

    def __init__(
        self, layout: _Layout, f: int, ids: Mapping[str, int], built: BuiltFiles, chunk_names: bool = False
    ) -> None:
        self.layout = layout
        self.f = f
        self.chunk_names = chunk_names  # each tensor named fqn@offsets of its box (a DCP chunk's name)
        self._ids = ids  # source path -> index in Plan.sources
        self.built = built
        self._serial = built.serial()
        self._stats: FileStats | None = None

    def __len__(self) -> int:
        return len(self.layout.members)

    @property
    def shares(self) -> tuple[tuple[BoxClass, Share], ...]:
        """(class, share) of every distinct class of this output (what validation checks once)."""
        seen = {id(cls): cls for cls, _, _ in self.layout.groups}
        return tuple((cls, cls.share(self.f)) for cls in seen.values())

    @property
    def stats(self) -> FileStats:
        if self._stats is None:
            copies = read = written = largest = 0
            for cls, count, dtype in self.layout.groups:
                share = cls.share(self.f)
                nbytes = share.elements * dtype.itemsize
                copies += count * len(share.copies)
                read += count * read_bytes(dtype, share.shape, share.read_elements, nbytes)
                written += count * nbytes
                largest = max(largest, nbytes)
            self._stats = FileStats(len(self), copies, read, written, largest)
        return self._stats

    def materialise(self) -> tuple[TensorPlan, ...]:
        """The ``TensorPlan`` tuple (built, or taken from the run's cache of recently built files)."""
        hit = self.built.get(self._serial)
        if hit is None:
            ids, f = self._ids, self.f
            names = (_chunk_name(m, f) if self.chunk_names else m.name for m in self.layout.members)
            hit = tuple(
                _tensor_plan(m.source, m.cls.share(f), name, ids)
                for m, name in zip(self.layout.members, names, strict=True)
            )
            self.built.put(self._serial, hit)
        return hit


def _chunk_name(m: _Member, f: int) -> str:
    """``fqn@o0,o1,...``: the member's name and its box's offsets in output ``f`` (``dcp.chunk_name``)."""
    box = m.cls.dst[f]
    assert box is not None, "an output holds only the targets with a box in it"
    return f"{m.name}@{','.join(str(a) for a, _ in box)}"


def _tensor_plan(source: ChunkedTensor, share: Share, name: str, ids: Mapping[str, int]) -> TensorPlan:
    files = source.files
    copies = tuple(Copy(ids[files[k]], source.tensor_of(k), s, d, n, w) for k, s, d, n, w in share.copies)
    return TensorPlan(name, source.dtype, share.shape, copies, share.elements * source.dtype.itemsize)


def plan_boxes(
    sources: Iterable[ChunkedTensor],
    files: Sequence[OutputFile],
    targets: Sequence[Target],
    operation: str = "reshard",
    orders: Sequence[Sequence[int]] | None = None,
    chunk_names: bool = False,
) -> Plan:
    """Plan ``targets`` into ``files`` from the chunks of ``sources``.

    Args:
        sources: The source tensors, each with its chunks (names unique).
        files: The output files, in order.
        targets: The destination tensors: each names a source tensor and gives its box in every
            output file (``None``: the file does not hold it).
        operation: The plan's ``operation``.
        orders: Per output file, the indexes of the targets it holds, in file order (default: the
            targets with a box for it, in ``targets`` order).
        chunk_names: Name each output tensor ``name@offsets`` of its box (a DCP chunk, ``formats.distcp_format``).

    Returns:
        A ``Plan`` whose files' tensors are built lazily (``BoxTensors``).

    Raises:
        LayoutError: A source's chunks do not tile it (outside, partial overlap, a hole).
        UsageError: A target names no source, a box lies outside its tensor, a file is listed twice.
    """
    by_name = _by_name(sources)
    if len({f.path for f in files}) != len(files):
        raise UsageError("an output file is listed twice")
    classes = _Classes()
    members = [_member(t, by_name, classes, len(files)) for t in targets]
    presence = _Presence(targets)
    layouts: dict[tuple[int, ...], _Layout] = {}
    interned, built = SourcePaths(), BuiltFiles()
    plans = []
    for f, out in enumerate(files):
        if orders is None:
            order = presence.order(f)
        else:
            order = tuple(orders[f])
            _check_present(order, targets, f)
        layout = layouts.get(order)
        if layout is None:
            layout = layouts[order] = _layout_of(order, members)
        for path in layout.paths(f):
            interned.id(path)
        tensors = BoxTensors(layout, f, interned.ids, built, chunk_names)
        plans.append(FilePlan(out.path, out.format, tensors, out.metadata, out.rank))
    return Plan(operation, tuple(interned.paths), tuple(plans))


def _by_name(sources: Iterable[ChunkedTensor]) -> dict[str, ChunkedTensor]:
    out: dict[str, ChunkedTensor] = {}
    for t in sources:
        if t.name in out:
            raise UsageError(f"source tensor {t.name!r} is given twice")
        if t.dtype is dtypes.STR:
            raise UnsupportedError(f"tensor {t.name!r}: strings are copied whole, not planned as boxes")
        out[t.name] = t
    return out


def _member(t: Target, by_name: Mapping[str, ChunkedTensor], classes: _Classes, n_files: int) -> _Member:
    source = by_name.get(t.tensor)
    if source is None:
        raise UsageError(f"no source tensor {t.tensor!r}")
    if len(t.boxes) != n_files:
        raise UsageError(f"tensor {t.out_name!r}: {len(t.boxes)} boxes for {n_files} output files")
    return _Member(classes.get(source, t.boxes), source, t.out_name)


class _Presence:
    """Which targets each output holds; a target present in every output costs nothing per output."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = targets
        holes: dict[int, bool] = {}  # per distinct boxes tuple: does some output lack it
        self.partial = []
        for i, t in enumerate(targets):
            hole = holes.get(id(t.boxes))
            if hole is None:
                hole = holes[id(t.boxes)] = None in t.boxes
            if hole:
                self.partial.append(i)
        self.everywhere = tuple(range(len(targets)))

    def order(self, f: int) -> tuple[int, ...]:
        absent = {i for i in self.partial if self.targets[i].boxes[f] is None}
        if not absent:
            return self.everywhere
        return tuple(i for i in self.everywhere if i not in absent)


def _check_present(order: Sequence[int], targets: Sequence[Target], f: int) -> None:
    """An explicit order lists only targets with a box in output ``f``."""
    for i in order:
        if not 0 <= i < len(targets):
            raise UsageError(f"output {f} lists target {i}, there are {len(targets)}")
        if targets[i].boxes[f] is None:
            raise UsageError(f"output {f} lists tensor {targets[i].out_name!r}, which has no box in it")


def _layout_of(order: tuple[int, ...], members: Sequence[_Member]) -> _Layout:
    chosen = [members[i] for i in order]
    names = [m.name for m in chosen]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"an output holds tensor {twice!r} twice")
    return _Layout(tuple(chosen))


def assembled_tensor(
    sources: SourcePaths, tensor: ChunkedTensor, box: Box, name: str | None = None, indexes: Indexes | None = None
) -> TensorPlan:
    """One destination tensor: box ``box`` of ``tensor``, its sources interned into ``sources``.

    ``indexes``: the run's indexes, so that tensors sharing a chunking are indexed once.
    """
    _check_boxes(tensor, (box,))
    index = indexes.of(tensor) if indexes is not None else ChunkIndex(tensor)
    share = relative_share(index, tensor.boxes, box)
    ids = {tensor.files[k]: sources.id(tensor.files[k]) for k, *_ in share.copies}
    return _tensor_plan(tensor, share, name if name is not None else tensor.name, ids)


# --------------------------------------------------------------------------------------------
# from the planning facts of MindSpore sources


def source_chunks(
    name: str,
    p: ParamLayout | None,
    full: tuple[int, ...],
    holders: Mapping[int, SourceFile],
    tensor: str | None = None,
) -> ChunkedTensor:
    """A laid-out tensor of MindSpore source files (``holders``: local rank -> file) as chunks.

    Every holder's slice must have the shape its rank's box has (the error names the file);
    each distinct box is read from the lowest rank holding it (``layout_chunks``).
    """
    key = tensor if tensor is not None else name
    boxes = rank_boxes(p, full)
    first = next(iter(holders.values()))
    for rank, src in holders.items():
        held = src.tensors[key].shape
        if rank < len(boxes) and held != box_shape(boxes[rank]):
            raise LayoutError(
                f"{key!r} has shape {list(held)}, but the strategy gives this rank a slice of "
                f"{list(box_shape(boxes[rank]))}",
                src.path,
            )
    homes = {rank: src.path_of(key) for rank, src in holders.items()}
    return layout_chunks(name, p, full, first.tensors[key].dtype, homes, key)


def strategy_chunks(files: Mapping[int, SourceFile], strategy: LayoutTable) -> list[ChunkedTensor]:
    """Every tensor of a MindSpore-style source (rank files and their strategy: rank folders, a
    Checkpoint 2.0's virtual rank files) as chunks.

    A laid-out tensor is read from its lowest pipeline stage's files (the stage whose layout the
    strategy's map gives it), each distinct slice from the lowest rank holding it; a tensor in no
    layout (``global_step``) is one whole chunk, from the lowest rank holding it. In file order.
    """
    lmap = layout_map(strategy)
    n = device_num(strategy, lmap)
    out: dict[str, ChunkedTensor] = {}
    elsewhere: dict[str, int] = {}  # laid-out tensors met only in another stage's files so far
    for r in sorted(files):
        for name, t in files[r].tensors.items():
            if name in out or t.dtype is dtypes.STR:
                continue
            staged = lmap.get(name)
            if staged is None:
                out[name] = whole_chunks(name, t.shape, t.dtype, files[r].path_of(name))
                continue
            stage = min(staged.stages)
            holders = {
                q - stage * n: files[q]
                for q in range(stage * n, (stage + 1) * n)
                if q in files and name in files[q].tensors
            }
            if not holders:
                elsewhere[name] = stage  # its own stage's files come later, or never (an error below)
                continue
            full = full_shape(staged.layout, next(iter(holders.values())).tensors[name].shape)
            out[name] = source_chunks(name, staged.layout, full, holders)
    for name, stage in elsewhere.items():
        if name not in out:
            raise LayoutError(f"tensor {name!r}: no file of its pipeline stage {stage} holds it", strategy.path)
    return list(out.values())


__all__ = [
    "BoxClass",
    "BoxTensors",
    "Indexes",
    "OutputFile",
    "Share",
    "Target",
    "assembled_tensor",
    "plan_boxes",
    "relative_share",
    "source_chunks",
    "strategy_chunks",
]
