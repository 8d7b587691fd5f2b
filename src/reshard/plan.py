"""Transfer plans: plain data that says where every output byte comes from.

A plan is computed from file *headers* and strategy files only, never from tensor data, so it
can be printed (``reshard plan``), tested without IO and shipped to other machines (Ray). Like
torch.distributed.checkpoint's ``ReadItem``, a copy is three tuples: the box start inside the
source tensor, the box start inside the destination tensor, and the box lengths. The executor
turns each copy into one strided numpy copy.

The planners here reproduce MindSpore's choices that decide *which* bytes land *where*: which
parameters an output file holds and in which order (spec 3.6, 3.9), which redundant source copy
supplies each element (spec 3.5), how ``unified_safetensors`` packs parts (spec 4.1), and how a
unified model is split per rank (spec 4.3). Layout arithmetic lives in ``reshard.layout``.

Planning 1 000 parameters for 1 024 ranks must take well under a second, but a million
``TensorPlan`` objects alone take seconds to build. So transform and split plans are built in
bulk and lazily:

* **Classes.** Parameters sharing (source layout, destination layout, full shape) share one
  ``_Class``: the layout engine's tables for all ranks (``layout.transfer_table``,
  ``layout.rank_boxes``) and, per destination rank, the copies relative to the box origins.
* **Templates.** Everything a destination rank's file depends on except the rank itself (tensor
  order, each tensor's class and candidate source files) is decided once per (load order, stage)
  in a ``_Template``; source files are checked against the real slice shapes once per (class,
  source rank), not per destination rank.
* **Lazy files.** ``FilePlan.tensors`` of such plans is a ``RankTensors`` sequence that builds its
  ``TensorPlan`` objects when iterated (executors take one file at a time) and answers totals
  (``FileStats``: counts, bytes) arithmetically, so ``Plan.summary()`` builds nothing.
* **One definition.** The plain per-parameter loops (``TransformPlanner.plan_rank``,
  ``_plan_split_reference``) stay the definition: the bulk path falls back to them whenever
  anything is off, so every error message is the one they raise, and the tests check that both
  paths give equal plans.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, overload

from reshard import dtypes, layout
from reshard.dtypes import DType
from reshard.errors import LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.formats import hf_index, layout_dir
from reshard.layout import LayoutTable, ParamLayout, StagedLayout, device_num, layout_map, stage_count

Box = tuple[tuple[int, int], ...]
PART_BYTES = 3 * 1024**3  # unified_safetensors' part size (spec 4.1 step 6)
REDUNDANT_STATE_PREFIXES = ("accu_grads", "adam_v", "adam_m")


@dataclass(frozen=True)
class Copy:
    """Copy one box: ``lengths`` elements per dim from ``src_start`` in the source tensor to ``dst_start``."""

    source: int  # index into Plan.sources
    tensor: str  # tensor name inside that source file
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    lengths: tuple[int, ...]
    whole_source: bool = False  # the box is the entire source tensor


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    copies: tuple[Copy, ...]
    nbytes: int
    literal: bytes | None = None  # content given in the plan itself (strings restored from metadata)

    @property
    def whole_copy(self) -> bool:
        """True when the tensor is one source tensor copied unchanged (also strings, scalars)."""
        return len(self.copies) == 1 and self.copies[0].whole_source and self.copies[0].lengths == self.shape

    @property
    def bytes_read(self) -> int:
        return _read_bytes(self.dtype, self.shape, sum(math.prod(c.lengths) for c in self.copies), self.nbytes)


def _read_bytes(dtype: DType, shape: tuple[int, ...], elements: int, nbytes: int) -> int:
    """Bytes a tensor reads from its sources: ``elements`` copied (strings count 1 a character)."""
    if not shape:
        return nbytes
    return elements * (dtype.itemsize if dtype is not dtypes.STR else 1)


@dataclass(frozen=True)
class FileStats:
    """Totals of one output file's tensors (lazy files answer them without building any tensor)."""

    tensors: int
    copies: int
    bytes_read: int
    bytes_written: int
    largest_tensor: int

    @staticmethod
    def of(tensors: Sequence[TensorPlan]) -> FileStats:
        if isinstance(tensors, RankTensors):
            return tensors.stats
        copies = read = written = largest = 0
        for t in tensors:
            copies += len(t.copies)
            read += t.bytes_read
            written += t.nbytes
            largest = max(largest, t.nbytes)
        return FileStats(len(tensors), copies, read, written, largest)


@dataclass(frozen=True)
class FilePlan:
    """One output file. ``tensors`` is a tuple, or (transform plans) a ``RankTensors`` sequence that
    builds its ``TensorPlan`` objects on access: iterate it, index it, take its ``len``."""

    path: str
    format: str
    tensors: Sequence[TensorPlan]
    metadata: tuple[tuple[str, str], ...] = ()
    rank: int | None = None

    @property
    def stats(self) -> FileStats:
        return FileStats.of(self.tensors)

    @property
    def nbytes(self) -> int:
        return self.stats.bytes_written

    @property
    def copy_count(self) -> int:
        """Number of copies of all tensors (without building them, for lazy files)."""
        return self.stats.copies


@dataclass(frozen=True)
class TextOutput:
    """A small text file a plan writes after its tensor files (index JSON, manifests)."""

    path: str
    text: str


@dataclass(frozen=True)
class Plan:
    operation: str
    sources: tuple[str, ...]
    files: tuple[FilePlan, ...]
    texts: tuple[TextOutput, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def bytes_written(self) -> int:
        return sum(f.stats.bytes_written for f in self.files)

    @property
    def bytes_read(self) -> int:
        return sum(f.stats.bytes_read for f in self.files)

    @property
    def largest_tensor(self) -> int:
        return max((f.stats.largest_tensor for f in self.files), default=0)

    def summary(self) -> dict[str, object]:
        stats = [f.stats for f in self.files]
        return {
            "operation": self.operation,
            "sources": len(self.sources),
            "outputs": len(self.files),
            "tensors": sum(s.tensors for s in stats),
            "copies": sum(s.copies for s in stats),
            "bytes_read": sum(s.bytes_read for s in stats),
            "bytes_written": sum(s.bytes_written for s in stats),
            "largest_tensor": max((s.largest_tensor for s in stats), default=0),
        }

    def to_json(self) -> dict[str, object]:
        return {
            **self.summary(),
            "source_files": list(self.sources),
            "files": [
                {
                    "path": f.path,
                    "format": f.format,
                    "rank": f.rank,
                    "bytes": f.nbytes,
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": t.dtype.ms_name,
                            "shape": list(t.shape),
                            "copies": [
                                [self.sources[c.source], c.tensor, list(c.src_start), list(c.dst_start),
                                 list(c.lengths)]
                                for c in t.copies
                            ],
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
            "texts": [t.path for t in self.texts],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class SourceTensor:
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class SourceFile:
    """What planning needs from one source file: its tensors' dtypes and shapes, in file order."""

    path: str
    rank: int
    tensors: dict[str, SourceTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    strings: dict[str, str] = field(default_factory=dict)  # values of string entries (small)


class _Sources:
    """Interns source paths into the plan's ``sources`` tuple."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.ids: dict[str, int] = {}

    def id(self, path: str) -> int:
        if path not in self.ids:
            self.ids[path] = len(self.paths)
            self.paths.append(path)
        return self.ids[path]


def _whole(sources: _Sources, src: SourceFile, name: str, out_name: str | None = None) -> TensorPlan:
    return _whole_at(sources.id(src.path), src, name, out_name)


def _whole_at(source: int, src: SourceFile, name: str, out_name: str | None = None) -> TensorPlan:
    """``src``'s tensor ``name`` copied unchanged; ``source`` is the index of ``src`` in the plan."""
    t = src.tensors[name]
    zeros = (0,) * len(t.shape)
    copy = Copy(source, name, zeros, zeros, t.shape, whole_source=True)
    return TensorPlan(out_name or name, t.dtype, t.shape, (copy,), t.nbytes)


def _box_start(box: Box) -> tuple[int, ...]:
    return tuple(a for a, _ in box)


def _assembled(
    sources: _Sources,
    name: str,
    out_name: str,
    pieces: Iterable[tuple[SourceFile, Box, Box]],
    dst_box: Box,
    dtype: DType,
) -> TensorPlan:
    """A tensor assembled from (source file, box held by that file, piece box) triples."""
    dst_origin = _box_start(dst_box)
    copies = []
    for src, held, piece in pieces:
        held_origin = _box_start(held)
        lengths = tuple(b - a for a, b in piece)
        copies.append(
            Copy(
                sources.id(src.path),
                name,
                tuple(a - o for (a, _), o in zip(piece, held_origin, strict=True)),
                tuple(a - o for (a, _), o in zip(piece, dst_origin, strict=True)),
                lengths,
                whole_source=lengths == src.tensors[name].shape,
            )
        )
    shape = tuple(b - a for a, b in dst_box)
    return TensorPlan(out_name, dtype, shape, tuple(copies), math.prod(shape) * dtype.itemsize)


# --------------------------------------------------------------------------------------------
# transform (spec 3.6, 3.9, 4.2)


@dataclass(frozen=True)
class StageCut:
    """Which names a destination rank keeps (spec 3.7/3.9 stage filtering)."""

    src: dict[str, StagedLayout] | None
    dst: dict[str, StagedLayout] | None
    dropped: frozenset[str]

    def keeps(self, name: str) -> bool:
        if self.src is None and self.dst is None:  # full model to full model: every name is kept
            return True
        not_local_src = self.src is None or (name in self.src and name in self.dropped)
        not_local_dst = self.dst is None or name in self.dropped
        return not (not_local_src and not_local_dst)

    def transforms(self, name: str) -> bool:
        in_src = self.src is None or (name in self.src and name not in self.dropped)
        in_dst = self.dst is None or (name in self.dst and name not in self.dropped)
        return in_src and in_dst


def _stage_cut(src_map: dict[str, StagedLayout] | None, dst_map: dict[str, StagedLayout] | None,
               stage: int) -> StageCut:
    dropped = frozenset(n for n, s in (dst_map or {}).items() if stage not in s.stages)
    return StageCut(src_map, dst_map, dropped)


class TransformPlanner:
    """Plans MindSpore's ``transform_checkpoints`` (all-stage mode) for any set of destination ranks."""

    def __init__(self, sources: Mapping[int, SourceFile], src: LayoutTable | None, dst: LayoutTable | None):
        self.files = dict(sources)
        self.src = src
        self.dst = dst
        self.src_map = layout_map(src) if src is not None else None
        self.n_src = device_num(src) if src is not None else 1
        self.n_dst = device_num(dst) if dst is not None else 1
        self.dst_total = self.n_dst * stage_count(dst) if dst is not None else 1
        self._dst_maps: dict[int, dict[str, StagedLayout]] = {}
        self.beyond: set[int] = set()  # destination ranks planned beyond what MindSpore can do
        self._shared: dict[str, int] | None = None  # see _own_stages

    def check_rank_count(self) -> None:
        """The source strategy must describe exactly the rank folders present."""
        expected = self.n_src * stage_count(self.src) if self.src is not None else 1
        found = sorted(self.files)
        if found != list(range(expected)):
            where = self.src.path if self.src is not None else None
            missing = sorted(set(range(expected)) - set(found))
            if found and missing and found[-1] < expected:  # the strategy is right; rank folders are missing
                folder = os.path.dirname(os.path.dirname(self.files[found[0]].path))
                raise UsageError(
                    f"no folder for rank(s) {_ranges(missing)}: the source strategy describes {expected} ranks "
                    f"(0..{expected - 1}), the checkpoint has rank folders {_ranges(found)}", folder)
            raise LayoutError(
                f"the source strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint has "
                f"{len(found)} rank folder(s) ({_ranges(found)})", where)

    def check_needed_present(self, wanted: Sequence[int]) -> None:
        """With chosen destination ranks (a node without a shared disk), only the source ranks they
        need must be present; every rank folder present must still be one the strategy describes."""
        expected = self.n_src * stage_count(self.src) if self.src is not None else 1
        extra = [r for r in sorted(self.files) if r >= expected]
        if extra:
            where = self.src.path if self.src is not None else None
            raise LayoutError(
                f"the source strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint has "
                f"rank folder(s) {_ranges(extra)}", where)
        base = os.path.dirname(os.path.dirname(next(iter(self.files.values())).path)) if self.files else ""
        for rank in wanted:
            missing = [r for r in sorted(self.needed(rank)) if r not in self.files]
            if missing:
                r = missing[0]
                others = f" (also missing: {_ranges(missing[1:])})" if len(missing) > 1 else ""
                raise UsageError(f"rank {r} is needed by destination rank {rank} but "
                                 f"{os.path.join(base, f'rank_{r}')} is missing{others}")

    def dst_map(self, rank: int) -> dict[str, StagedLayout] | None:
        if self.dst is None:
            return None
        key = rank // self.n_dst  # the rank-aware choice only depends on the stage
        if key not in self._dst_maps:
            self._dst_maps[key] = layout_map(self.dst, rank)
        return self._dst_maps[key]

    def needed(self, rank: int) -> list[int]:
        """Source ranks needed by destination ``rank`` (MindSpore's rank_list_for_transform).

        Beyond MindSpore: when a parameter's source and destination device counts do not divide
        each other (4 -> 6 ranks), MindSpore refuses; we read the source ranks whose slices overlap.
        """
        if self.src is None:
            return [0]
        try:
            return layout.rank_list_for_transform(rank, self.src_map, self.dst_map(rank))
        except LayoutError:
            # MindSpore cannot (device counts that do not divide, or its fake probe shape does not
            # divide the layout); real shapes decide: if they do not divide either, planning says so.
            self.beyond.add(rank)
        return self._overlapping_ranks(rank)

    def _overlapping_ranks(self, rank: int) -> list[int]:
        """Source ranks whose slices overlap destination ``rank``'s, by real shapes, in MindSpore's
        form: the local ranks any parameter needs, repeated in every source stage that holds a
        parameter this destination stage keeps (so names take the position they take in the
        dividing path: their first appearance in this load order), descending."""
        dst_map = self.dst_map(rank)
        cut = _stage_cut(self.src_map, dst_map, rank // self.n_dst)
        keys: set[int] = set()
        for name, staged in (self.src_map or {}).items():
            if not cut.transforms(name):
                continue
            held = self._any_file_with(name, staged.stages)
            if held is None:
                continue
            with _blame(name, self.src, f"the slice in {os.path.basename(held.path)}"):
                full = layout.full_shape(staged.layout, held.tensors[name].shape)
            dst_p = dst_map[name].layout if dst_map is not None else None
            with _blame(name, self.dst, f"full shape {list(full)}"):
                pieces = layout.transfer_pieces(staged.layout, dst_p, full, rank % self.n_dst, any_device_num=True)
            keys |= {key for key, _ in pieces}
        stages = {s for name, staged in (self.src_map or {}).items() if name not in cut.dropped for s in staged.stages}
        return sorted({s * self.n_src + key for s in stages for key in keys}, reverse=True)

    def holders(self, load_order: Sequence[int], own_stage_only: bool) -> dict[str, dict[int, SourceFile]]:
        """name -> {source local rank: file}, as loading ``load_order`` leaves it (a later file
        replaces an earlier one's local rank; names keep their first position).

        ``own_stage_only`` (device counts that do not divide): a parameter held by several source
        stages, each with its own layout, is taken only from the files of the stage whose layout the
        source map gives it (its lowest stage). Every file is then read with its own stage's layout,
        as in the dividing path, where the needed ranks repeat in every stage and the lowest stage's
        file wins; here a load order may hold another stage's file for a local rank the lowest
        stage's files do not supply, and its slice has a different shape or content.
        """
        own_stage = self._own_stages() if own_stage_only else {}
        holders: dict[str, dict[int, SourceFile]] = {}
        passed_over: dict[str, dict[int, SourceFile]] = {}  # other stages' files of shared parameters
        for r in load_order:
            f = self.files[r]
            stage = r // self.n_src
            for name in f.tensors:
                by_key = holders.setdefault(name, {})  # the position is the first appearance, as always
                if own_stage.get(name, stage) == stage:
                    by_key[r % self.n_src] = f
                else:
                    passed_over.setdefault(name, {})[r % self.n_src] = f
        for name, by_key in passed_over.items():
            if not holders[name]:  # none of its own stage's files loaded: the usual checks decide
                holders[name] = by_key
        return holders

    def _own_stages(self) -> dict[str, int]:
        """Source parameters held by several stages -> the stage whose layout ``src_map`` gives them."""
        if self._shared is None:
            self._shared = {n: min(s.stages) for n, s in (self.src_map or {}).items() if len(s.stages) > 1}
        return self._shared

    def _any_file_with(self, name: str, stages: tuple[int, ...]) -> SourceFile | None:
        """A file holding ``name`` in its lowest stage (the one ``src_map``'s layout describes)."""
        for stage in sorted(stages)[:1]:
            for r in range(stage * self.n_src, (stage + 1) * self.n_src):
                if r in self.files and name in self.files[r].tensors:
                    return self.files[r]
        return None

    def plan_rank(self, rank: int, sources: _Sources, load_order: Sequence[int] | None = None
                  ) -> tuple[TensorPlan, ...]:
        """The tensors of destination ``rank``'s file.

        Source files are "loaded" in ``load_order`` (default: the needed ranks, descending, as
        ``transform_checkpoints`` does); a later file overwrites an earlier one's slice with the
        same local rank (so the lowest pipeline stage wins), and names keep their first position.
        """
        if load_order is None:
            load_order = self.needed(rank)
            missing = [r for r in load_order if r not in self.files]
            if missing:
                raise UsageError(f"destination rank {rank} needs the checkpoint of source rank(s) "
                                 f"{', '.join(map(str, sorted(missing)))}, which is missing")
        holders = self.holders(load_order, rank in self.beyond)
        dst_map = self.dst_map(rank)
        cut = _stage_cut(self.src_map, dst_map, rank // self.n_dst)
        local = rank % self.n_dst
        transformed: list[TensorPlan] = []
        deferred: list[str] = []
        device_n: int | None = None
        for name, by_key in holders.items():
            if not cut.keeps(name):
                continue
            if not cut.transforms(name):
                deferred.append(name)
                continue
            src_p = self.src_map[name].layout if self.src_map is not None else None
            dst_p = dst_map[name].layout if dst_map is not None else None
            device_n = src_p.device_num if src_p is not None else 1
            transformed.append(self._transform_one(name, src_p, dst_p, by_key, local, sources))
        if device_n is None:
            raise LayoutError("none of the checkpoint's parameters is in the source or destination strategy")
        for name in deferred:
            key = local % device_n
            if key not in holders[name] and rank in self.beyond:
                key = min(holders[name])  # no MindSpore rule to follow: the lowest rank's copy
            if key not in holders[name]:
                raise UsageError(f"parameter {name!r} is missing from the checkpoint of source rank {key}")
            transformed.append(_whole(sources, holders[name][key], name))
        return tuple(transformed)

    def _transform_one(self, name: str, src_p: ParamLayout | None, dst_p: ParamLayout | None,
                       by_key: dict[int, SourceFile], local: int, sources: _Sources) -> TensorPlan:
        first = next(iter(by_key.values())).tensors[name]
        with _blame(name, self.src, f"the slice in {os.path.basename(next(iter(by_key.values())).path)}"):
            full = layout.full_shape(src_p, first.shape) if src_p is not None else first.shape
        with _blame(name, self.dst, f"full shape {list(full)}"):
            dst_box = layout.rank_box(dst_p, full, local) if dst_p is not None else tuple((0, d) for d in full)
        with _blame(name, self.src, f"full shape {list(full)}"):
            return self._pieces(name, src_p, dst_p, by_key, local, sources, full, dst_box, first.dtype)

    def _pieces(self, name: str, src_p: ParamLayout | None, dst_p: ParamLayout | None,
                by_key: dict[int, SourceFile], local: int, sources: _Sources, full: tuple[int, ...],
                dst_box: Box, dtype: DType) -> TensorPlan:
        triples = []
        for key, piece in layout.transfer_pieces(src_p, dst_p, full, local, any_device_num=True):
            held = layout.rank_box(src_p, full, key) if src_p is not None else tuple((0, d) for d in full)
            src = by_key.get(key) or _redundant_copy(name, src_p, full, held, by_key)
            if src is None:
                raise UsageError(f"the checkpoint of source rank {key} is missing (needed for {name!r})")
            if src.tensors[name].shape != tuple(b - a for a, b in held):
                raise LayoutError(
                    f"{name!r} has shape {list(src.tensors[name].shape)}, but the strategy gives this rank "
                    f"a slice of {[b - a for a, b in held]}", src.path)
            triples.append((src, held, piece))
        return _assembled(sources, name, name, triples, dst_box, dtype)


@contextlib.contextmanager
def _blame(name: str, strategy: LayoutTable | None, what: str) -> Iterator[None]:
    """Re-raise a layout error naming the parameter, the strategy file and what it was applied to."""
    try:
        yield
    except LayoutError as exc:
        if exc.path and name in exc.detail:
            raise
        where = strategy.path if strategy is not None else exc.path
        raise LayoutError(f"parameter {name!r} ({what}): {exc.detail}", where) from None


def _redundant_copy(name: str, src_p: ParamLayout | None, full: tuple[int, ...], held: Box,
                    by_key: Mapping[int, SourceFile]) -> SourceFile | None:
    """Another rank's identical copy of a slice, for checkpoints saved with ``remove_redundancy=True``
    (each slice is stored by only one rank of its redundancy group)."""
    if src_p is None:
        return None
    for key in sorted(by_key):
        if layout.rank_box(src_p, full, key) == held:
            return by_key[key]
    return None


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,5`` style text for a sorted rank list."""
    parts: list[str] = []
    for r in ranks:
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


# --------------------------------------------------------------------------------------------
# bulk transform planning: shared per-class tables, lazy tensor lists


CopyShape = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]  # key, src/dst start, lengths, whole
MATERIALISED_FILES = 8  # files whose TensorPlans stay built: the ones an executor has in flight, not the plan


@dataclass(frozen=True)
class _Local:
    """One destination rank's share of one class: its box and copies, relative to the origins."""

    shape: tuple[int, ...]
    copies: tuple[CopyShape, ...]
    keys: tuple[int, ...]  # source key of each copy, in copy order
    key_set: frozenset[int]
    elements: int
    read_elements: int  # sum of the copies' volumes


class _Class:
    """One (source layout, destination layout, full shape): the layout engine's answer for all ranks.

    Parameters sharing it share every tuple a ``Copy`` holds; per destination rank only the
    source file (hence the source index) and the tensor name differ.
    """

    def __init__(self, src_p: ParamLayout | None, dst_p: ParamLayout | None, full: tuple[int, ...]) -> None:
        self.src_p, self.dst_p, self.full = src_p, dst_p, full
        self.dst_boxes = layout.rank_boxes(dst_p, full)  # first, as plan_rank asks for the box first
        self.table = layout.transfer_table(src_p, dst_p, full, any_device_num=True)
        self.src_boxes = layout.rank_boxes(src_p, full)
        self._locals: dict[int, _Local] = {}

    def local(self, rank: int) -> _Local:
        hit = self._locals.get(rank)
        if hit is None:
            if not rank < min(len(self.table), len(self.dst_boxes)):
                raise LayoutError(f"rank {rank} is outside the {len(self.table)} devices of the destination layout")
            hit = self._locals[rank] = self._relative(rank)
        return hit

    def _relative(self, rank: int) -> _Local:
        dst_origin = _box_start(self.dst_boxes[rank])
        copies: list[CopyShape] = []
        for key, piece in self.table[rank]:
            held = self.src_boxes[key]
            lengths = tuple(b - a for a, b in piece)
            start = _box_start(piece)
            copies.append((
                key,
                tuple(a - o for a, o in zip(start, _box_start(held), strict=True)),
                tuple(a - o for a, o in zip(start, dst_origin, strict=True)),
                lengths,
                lengths == tuple(b - a for a, b in held),
            ))
        shape = tuple(b - a for a, b in self.dst_boxes[rank])
        keys = tuple(c[0] for c in copies)
        return _Local(shape, tuple(copies), keys, frozenset(keys), math.prod(shape),
                      sum(math.prod(c[3]) for c in copies))


class _Transformed:
    """One transformed parameter of a template (a slotted class: templates hold one per parameter)."""

    __slots__ = ("cls", "dtype", "files", "held_by", "name", "tensor")

    def __init__(self, name: str, tensor: str, cls: int, dtype: DType, held_by: dict[int, SourceFile]) -> None:
        self.name = name  # in the output
        self.tensor = tensor  # in the source files (differs when a split renames keys)
        self.cls = cls  # index into _Template.classes
        self.dtype = dtype
        self.held_by = held_by  # source key -> file, as the load order leaves it
        self.files = held_by  # the same plus redundant copies found for missing keys (copied on first write)

    def add_file(self, key: int, src: SourceFile) -> None:
        if self.files is self.held_by:
            self.files = dict(self.held_by)
        self.files[key] = src


class _Template:
    """What one (load order, stage) decides for every destination rank sharing it.

    The output's tensor order, each tensor's class and candidate source files, and which
    (class, source key) combinations were already checked against the files' real shapes.
    """

    def __init__(self) -> None:
        self.transformed: list[_Transformed] = []
        self.classes: list[_Class] = []
        self.members: list[list[_Transformed]] = []  # per class
        self.checked: list[set[int]] = []  # per class: source keys resolved for every member
        self.deferred: list[tuple[str, dict[int, SourceFile]]] = []  # copied whole (not in both strategies)
        self.device_n: int | None = None  # the last transformed parameter's source device count [MindSpore]
        self.groups: tuple[tuple[int, int, DType], ...] = ()  # (class, parameters, dtype) for totals
        self._counts: dict[tuple[int, int], list] = {}  # (class, id(dtype)) -> [count, dtype]
        self.wholes: dict[tuple[int, bool], tuple[tuple[SourceFile, ...], FileStats]] = {}
        self.orders: dict[tuple[object, ...], tuple[str, ...]] = {}  # source paths in first-use order

    def add(self, t: _Transformed, cls: _Class) -> None:
        if t.cls == len(self.classes):
            self.classes.append(cls)
            self.members.append([])
            self.checked.append(set())
        self.members[t.cls].append(t)
        self.transformed.append(t)
        group = self._counts.get((t.cls, id(t.dtype)))
        if group is None:
            self._counts[(t.cls, id(t.dtype))] = [1, t.dtype]
        else:
            group[0] += 1

    def finish(self) -> None:
        self.groups = tuple((c, n, d) for (c, _), (n, d) in self._counts.items())

    def resolve(self, index: int, keys: frozenset[int]) -> None:
        """Pick the file of every member for ``keys`` and check its shape (errors: see ``_BulkPlanner``)."""
        cls = self.classes[index]
        for key in sorted(keys - self.checked[index]):
            held = cls.src_boxes[key]
            lengths = tuple(b - a for a, b in held)
            for t in self.members[index]:
                src = t.held_by.get(key) or _redundant_copy(t.tensor, cls.src_p, cls.full, held, t.held_by)
                if src is None or src.tensors[t.tensor].shape != lengths:
                    raise LayoutError(f"no source file holds the slice of source rank {key} of {t.name!r}")
                if key not in t.held_by:
                    t.add_file(key, src)
            self.checked[index].add(key)

    def whole(self, key: int, beyond: bool) -> tuple[tuple[SourceFile, ...], FileStats]:
        """Files of the deferred parameters (copied whole) for destination ranks with ``key``."""
        hit = self.wholes.get((key, beyond))
        if hit is None:
            files: list[SourceFile] = []
            read = written = largest = 0
            for name, by_key in self.deferred:
                k = min(by_key) if key not in by_key and beyond else key
                if k not in by_key:
                    raise UsageError(f"parameter {name!r} is missing from the checkpoint of source rank {k}")
                files.append(by_key[k])
                t = by_key[k].tensors[name]
                read += _read_bytes(t.dtype, t.shape, math.prod(t.shape), t.nbytes)
                written += t.nbytes
                largest = max(largest, t.nbytes)
            n = len(files)
            hit = self.wholes[(key, beyond)] = (tuple(files), FileStats(n, n, read, written, largest))
        return hit

    def source_order(self, locals_: tuple[_Local, ...], wholes: tuple[SourceFile, ...]) -> tuple[str, ...]:
        """Source paths of one rank in first-use order (what per-tensor interning would produce)."""
        key = (tuple(loc.keys for loc in locals_), id(wholes))
        hit = self.orders.get(key)
        if hit is None:
            seen: dict[str, None] = {}
            for t in self.transformed:
                for k in locals_[t.cls].keys:
                    seen[t.files[k].path] = None
            for f in wholes:
                seen[f.path] = None
            hit = self.orders[key] = tuple(seen)
        return hit


class RankTensors(Sequence[TensorPlan]):
    """The tensors of one transform output, built on access from shared per-class tables.

    A 1 000-parameter x 1 024-rank plan would otherwise hold a million ``TensorPlan`` objects
    before the first byte moves; executors look at one file at a time. Totals (``stats``) come
    from the tables without building anything. The last few built files stay cached
    (``MATERIALISED_FILES``), so an executor iterating a file several times builds it once.
    Pickling (Ray) and equality see a plain tuple of ``TensorPlan``.
    """

    _serials: ClassVar[Iterator[int]] = itertools.count()
    _built: ClassVar[OrderedDict[int, tuple[TensorPlan, ...]]] = OrderedDict()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, template: _Template, locals_: tuple[_Local, ...], wholes: tuple[SourceFile, ...],
                 whole_stats: FileStats, ids: Mapping[str, int]) -> None:
        self._template = template
        self._locals = locals_
        self._wholes = wholes
        self._whole_stats = whole_stats
        self._ids = ids  # source path -> index in Plan.sources (complete once planning ends)
        self._serial = next(self._serials)
        self._stats: FileStats | None = None

    def __len__(self) -> int:
        return len(self._template.transformed) + len(self._wholes)

    @overload
    def __getitem__(self, index: int) -> TensorPlan: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[TensorPlan, ...]: ...
    def __getitem__(self, index: int | slice) -> TensorPlan | tuple[TensorPlan, ...]:
        return self.materialise()[index]

    def __iter__(self) -> Iterator[TensorPlan]:
        return iter(self.materialise())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankTensors | tuple):
            return self.materialise() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.materialise())

    def __repr__(self) -> str:
        return f"RankTensors({len(self)} tensors)"

    def __reduce__(self) -> tuple[type, tuple[tuple[TensorPlan, ...]]]:
        return tuple, (self.materialise(),)

    @property
    def stats(self) -> FileStats:
        if self._stats is None:
            copies = read = written = largest = 0
            for index, count, dtype in self._template.groups:
                loc = self._locals[index]
                nbytes = loc.elements * dtype.itemsize
                copies += count * len(loc.copies)
                read += count * _read_bytes(dtype, loc.shape, loc.read_elements, nbytes)
                written += count * nbytes
                largest = max(largest, nbytes)
            w = self._whole_stats
            self._stats = FileStats(len(self), copies + w.copies, read + w.bytes_read, written + w.bytes_written,
                                    max(largest, w.largest_tensor))
        return self._stats

    def materialise(self) -> tuple[TensorPlan, ...]:
        """The ``TensorPlan`` tuple (built, or taken from the cache of recently built files)."""
        with self._lock:
            hit = self._built.get(self._serial)
            if hit is not None:
                self._built.move_to_end(self._serial)
                return hit
        built = self._build()
        with self._lock:
            self._built[self._serial] = built
            while len(self._built) > MATERIALISED_FILES:
                self._built.popitem(last=False)
        return built

    def _build(self) -> tuple[TensorPlan, ...]:
        ids, locals_ = self._ids, self._locals
        out: list[TensorPlan] = []
        for t in self._template.transformed:
            loc, files, tensor = locals_[t.cls], t.files, t.tensor
            copies = tuple(Copy(ids[files[k].path], tensor, s, d, n, w) for k, s, d, n, w in loc.copies)
            out.append(TensorPlan(t.name, t.dtype, loc.shape, copies, loc.elements * t.dtype.itemsize))
        for (name, _), src in zip(self._template.deferred, self._wholes, strict=True):
            out.append(_whole_at(ids[src.path], src, name))
        return tuple(out)


class _Tables:
    """The classes of one planning run, by (source layout, destination layout, full shape).

    Looked up once per parameter and template, so the first lookup is by the layouts' identity
    (hashing and comparing frozen layouts field by field costs more than the rest of a lookup);
    equal layouts held by different objects still share one class through the second. Every
    layout looked up by identity stays referenced by the entry, so its id cannot be reused.
    """

    def __init__(self) -> None:
        self._classes: dict[tuple[ParamLayout | None, ParamLayout | None, tuple[int, ...]], _Class] = {}
        self._by_id: dict[tuple[int, int, tuple[int, ...]], tuple[ParamLayout | None, ParamLayout | None, _Class]] = {}
        self._fulls: dict[tuple[int, tuple[int, ...]], tuple[ParamLayout, tuple[int, ...]]] = {}

    def full(self, src_p: ParamLayout | None, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``layout.full_shape``, once per (layout, slice shape)."""
        if src_p is None:
            return shape
        hit = self._fulls.get((id(src_p), shape))
        if hit is None:
            hit = self._fulls[(id(src_p), shape)] = (src_p, layout.full_shape(src_p, shape))
        return hit[1]

    def get(self, src_p: ParamLayout | None, dst_p: ParamLayout | None, full: tuple[int, ...]) -> _Class:
        hit = self._by_id.get((id(src_p), id(dst_p), full))
        if hit is None:
            cls = self._classes.get((src_p, dst_p, full))
            if cls is None:
                cls = self._classes[(src_p, dst_p, full)] = _Class(src_p, dst_p, full)
            hit = self._by_id[(id(src_p), id(dst_p), full)] = (src_p, dst_p, cls)
        return hit[2]


def _add_transformed(template: _Template, class_index: dict[int, int], cls: _Class, name: str, tensor: str,
                     dtype: DType, held_by: dict[int, SourceFile]) -> None:
    index = class_index.setdefault(id(cls), len(class_index))
    template.add(_Transformed(name, tensor, index, dtype, held_by), cls)


def _rank_tensors(template: _Template, local: int, beyond: bool, sources: _Sources) -> RankTensors:
    """One destination rank's lazy tensors: its share of every class, its files checked, its sources interned."""
    locals_ = tuple(cls.local(local) for cls in template.classes)
    for index, loc in enumerate(locals_):
        if not loc.key_set <= template.checked[index]:
            template.resolve(index, loc.key_set)
    device_n = template.device_n if template.device_n is not None else 1
    wholes, whole_stats = template.whole(local % device_n, beyond)
    for path in template.source_order(locals_, wholes):
        sources.id(path)
    return RankTensors(template, locals_, wholes, whole_stats, sources.ids)


_SKIP = "skip"  # roles of a parameter in a destination stage: not in this rank's file,
_WHOLE = "whole"  # copied whole from one source file, or transformed: (src layout, dst layout, src devices)
_Role = str | tuple[ParamLayout | None, ParamLayout | None, int]


class _BulkPlanner:
    """``plan_transform``'s fast path over a ``TransformPlanner``: same plans, built from tables.

    Per destination rank it only looks up a template (by load order and stage), one ``_Local``
    per class and the source files not yet checked; ``TensorPlan`` objects are left to
    ``RankTensors``. Whenever anything is wrong the rank is planned again by the reference path
    (``TransformPlanner.plan_rank``), which raises the exact error a user should see, naming the
    parameter and the strategy file; the fast path's own errors are only a signal.
    """

    def __init__(self, planner: TransformPlanner) -> None:
        self.planner = planner
        self.sources = _Sources()
        self.tables = _Tables()
        self._templates: dict[tuple[tuple[int, ...], int, bool], _Template] = {}
        self._stages: dict[int, tuple[dict[str, _Role], StageCut, dict[str, StagedLayout] | None]] = {}

    def rank(self, rank: int) -> RankTensors:
        p = self.planner
        order = p.needed(rank)
        missing = [r for r in order if r not in p.files]
        if missing:
            raise UsageError(f"destination rank {rank} needs the checkpoint of source rank(s) "
                             f"{', '.join(map(str, sorted(missing)))}, which is missing")
        beyond = rank in p.beyond
        try:
            template = self._template(tuple(order), rank // p.n_dst, beyond)
            return _rank_tensors(template, rank % p.n_dst, beyond, self.sources)
        except ReshardError:
            p.plan_rank(rank, _Sources(), order)  # raises the precise, blamed error
            raise

    def _template(self, order: tuple[int, ...], stage: int, beyond: bool) -> _Template:
        hit = self._templates.get((order, stage, beyond))
        if hit is None:
            hit = self._templates[(order, stage, beyond)] = self._build_template(order, stage, beyond)
        return hit

    def _build_template(self, order: tuple[int, ...], stage: int, beyond: bool) -> _Template:
        """``plan_rank``'s loop over parameters, minus everything that depends on the rank."""
        p = self.planner
        holders = p.holders(order, beyond)
        roles, cut, dst_map = self._stage(stage)
        template = _Template()
        class_index: dict[int, int] = {}  # id(_Class) -> index in template.classes
        tables = self.tables
        for name, by_key in holders.items():
            role = roles.get(name)
            if role is None:
                role = roles[name] = self._role(name, cut, dst_map)
            if role is _SKIP:
                continue
            if role is _WHOLE:
                template.deferred.append((name, by_key))
                continue
            src_p, dst_p, template.device_n = role
            first = next(iter(by_key.values())).tensors[name]
            cls = tables.get(src_p, dst_p, tables.full(src_p, first.shape))
            _add_transformed(template, class_index, cls, name, name, first.dtype, by_key)
        if template.device_n is None:
            raise LayoutError("no parameter to transform")
        template.finish()
        return template

    def _stage(self, stage: int) -> tuple[dict[str, _Role], StageCut, dict[str, StagedLayout] | None]:
        """A destination stage's cut and layout map, and a memo of what ``plan_rank`` does with each name."""
        hit = self._stages.get(stage)
        if hit is None:
            p = self.planner
            dst_map = p.dst_map(stage * p.n_dst)
            hit = self._stages[stage] = ({}, _stage_cut(p.src_map, dst_map, stage), dst_map)
        return hit

    def _role(self, name: str, cut: StageCut, dst_map: dict[str, StagedLayout] | None) -> _Role:
        p = self.planner
        if not cut.keeps(name):
            return _SKIP
        if not cut.transforms(name):
            return _WHOLE
        src_p = p.src_map[name].layout if p.src_map is not None else None
        dst_p = dst_map[name].layout if dst_map is not None else None
        return src_p, dst_p, src_p.device_num if src_p is not None else 1


def plan_transform(
    sources: Mapping[int, SourceFile],
    src: LayoutTable | None,
    dst: LayoutTable | None,
    dst_dir: str,
    prefix: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """Plan a transform of a distributed (or full) checkpoint into ``dst_dir/rank_<r>/``."""
    planner = TransformPlanner(sources, src, dst)
    wanted = _wanted_ranks(ranks, planner.dst_total)
    if ranks is None:
        planner.check_rank_count()
    else:
        planner.check_needed_present(wanted)
    bulk = _BulkPlanner(planner)
    meta = _meta(output_format)
    files = []
    for rank in wanted:
        path = layout_dir.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, bulk.rank(rank), meta, rank))
    return Plan("transform", tuple(bulk.sources.paths), tuple(files))


def _wanted_ranks(ranks: Sequence[int] | None, total: int) -> list[int]:
    """The destination ranks to plan (all by default); any outside ``0..total-1`` is a usage error."""
    wanted = list(range(total)) if ranks is None else list(ranks)
    bad = [r for r in wanted if not 0 <= r < total]
    if bad:
        raise UsageError(f"destination rank(s) {bad} out of range 0..{total - 1}")
    return wanted


def _bulk_or_reference(bulk: Callable[..., Plan | None] | None, reference: Callable[..., Plan], *args: Any) -> Plan:
    """The fast planner's plan, or the reference loop's where the fast one declines or meets an error
    (the reference loop is the definition: it raises the precise, blamed error)."""
    try:
        plan = bulk(*args) if bulk is not None else None
    except ReshardError:
        plan = None
    return plan if plan is not None else reference(*args)


def _meta(fmt: str) -> tuple[tuple[str, str], ...]:
    return (("format", "ms"),) if fmt == "safetensors" else ()


def plan_transform_by_rank(
    rank: int,
    files_map: Mapping[int, SourceFile],
    out_path: str,
    src: LayoutTable | None,
    dst: LayoutTable | None,
) -> Plan:
    """Plan ``transform_checkpoint_by_rank``: one destination file from the given source files.

    Files are taken in the map's order (a later file overwrites the same local slice of an
    earlier one), exactly as MindSpore loads them.
    """
    planner = TransformPlanner(files_map, src, dst)
    order = list(files_map)
    interned = _Sources()
    fmt = layout_dir.detect_format(out_path)
    tensors = planner.plan_rank(rank, interned, order)
    return Plan("transform", tuple(interned.paths), (FilePlan(out_path, fmt, tensors, _meta(fmt), rank),))


# --------------------------------------------------------------------------------------------
# unify (spec 4.1)

ChoiceFunc = Callable[[str], object]


def _bin_pack(sizes: Sequence[tuple[str, int]], groups: int) -> list[list[str]]:
    """Greedy: largest first (stable), each into the group with the smallest total (first on ties)."""
    order = sorted(sizes, key=lambda item: -item[1])
    bins: list[list[str]] = [[] for _ in range(groups)]
    totals = [0] * groups
    for name, size in order:
        i = totals.index(min(totals))
        bins[i].append(name)
        totals[i] += size
    return bins


def _choice(choice_func: ChoiceFunc | None, name: str) -> object:
    if choice_func is None:
        return True
    result = choice_func(name)
    if not isinstance(result, (bool, str)):
        raise UsageError(f"choice_func must return bool or str, got {type(result).__name__} for {name!r}")
    return result


def plan_unify(
    sources: Mapping[int, SourceFile],
    src: LayoutTable,
    dst_dir: str,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    part_bytes: int = PART_BYTES,
) -> Plan:
    """Plan ``unified_safetensors``: full tensors in ~3 GiB parts, an index, and hyper parameters."""
    planner = TransformPlanner(sources, src, None)
    needed = planner.needed(0)
    missing = [r for r in needed if r not in planner.files]
    if missing:
        where = os.path.dirname(os.path.dirname(next(iter(planner.files.values())).path)) if planner.files else None
        raise UsageError(f"no folder for rank(s) {_ranges(sorted(missing))}, which the full tensors need", where)
    src_map = planner.src_map or {}
    actual = {n for f in planner.files.values() for n in f.tensors}
    name_set = {n for n in actual & set(src_map) if not n.startswith("accu_grads")}
    sizes: dict[str, int] = {}
    renamed: dict[str, str] = {}
    rejected: set[str] = set()
    for f in planner.files.values():
        for name, t in f.tensors.items():
            if name not in name_set or name in sizes or name in rejected:
                continue
            choice = _choice(choice_func, name)
            if choice is False:
                rejected.add(name)
                continue
            if isinstance(choice, str):
                renamed[name] = choice
            full = layout.full_shape(src_map[name].layout, t.shape)
            sizes[name] = math.prod(full) * t.dtype.itemsize
    name_set -= rejected
    total = sum(sizes.values())
    split_num = max(1, min(math.ceil(total / part_bytes), len(sizes))) if sizes else 1
    groups = _bin_pack(list(sizes.items()), split_num)
    selected = _split_selection(len(groups), split_dst_file)
    interned = _Sources()
    files: list[FilePlan] = []
    texts: list[TextOutput] = []
    holders: dict[str, dict[int, SourceFile]] = {}
    for r in needed:
        for name in planner.files[r].tensors:
            holders.setdefault(name, {})[r % planner.n_src] = planner.files[r]
    read_ranks = list(dict.fromkeys(needed))  # each source file's metadata once, in load order
    for j in selected:
        tensors = [
            planner._transform_one(name, src_map[name].layout, None, holders[name], 0, interned)
            for name in groups[j]
        ]
        tensors = [TensorPlan(renamed.get(t.name, t.name), t.dtype, t.shape, t.copies, t.nbytes) for t in tensors]
        meta: dict[str, str] = {"format": "ms"}
        for r in read_ranks:  # MindSpore merges in set order; ours is the load order: same bytes every run
            meta.update(planner.files[r].metadata)
        if "remove_redundancy" in meta:
            meta["remove_redundancy"] = "False"
        files.append(FilePlan(os.path.join(dst_dir, f"part{j}.safetensors"), "safetensors", tuple(tensors),
                              tuple(meta.items())))
    if not split_dst_file or split_dst_file[0] == 1:
        rank0 = planner.files.get(0)
        if rank0 is not None:
            hyper = tuple(_whole(interned, rank0, n) for n in rank0.tensors if n not in name_set)
            if hyper:
                files.append(FilePlan(os.path.join(dst_dir, "hyper_param.safetensors"), "safetensors", hyper,
                                      (("format", "ms"),)))
        weight_map = {renamed.get(n, n): f"part{j}.safetensors" for j, g in enumerate(groups) for n in g}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        texts.append(TextOutput(os.path.join(dst_dir, "param_name_map.json"), json.dumps(index, indent=4)))
    return Plan("unify", tuple(interned.paths), tuple(files), tuple(texts))


def _split_selection(count: int, split_dst_file: tuple[int, int] | tuple[()]) -> list[int]:
    if not split_dst_file:
        return list(range(count))
    index, parts = split_dst_file
    if not (isinstance(index, int) and isinstance(parts, int) and 1 <= index <= parts):
        raise UsageError(f"split_dst_file must be (i, n) with 1 <= i <= n, got {split_dst_file}")
    base, extra = divmod(count, parts)
    start = (index - 1) * base + min(index - 1, extra)
    stop = start + base + (1 if index - 1 < extra else 0)
    return list(range(start, stop))


# --------------------------------------------------------------------------------------------
# split a unified model into per-rank files (spec 4.3)


def plan_split(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    hyper: SourceFile | None,
    dst: LayoutTable,
    dst_dir: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
    name_map: Mapping[str, str] | None = None,
    file_name: str = "net",
) -> Plan:
    """Plan ``load_distributed_checkpoint`` save mode: slice full tensors for every destination rank.

    ``name_to_file`` maps *strategy* names to part files; the tensor is read under the file key
    ``name_map[name]`` (MindFormers renames keys but keeps original names in the index).
    Planned like a transform from full tensors (shared tables, lazy ``RankTensors``); when that
    fast path meets anything unusual, the reference loop ``_plan_split_reference`` decides.
    """
    wanted = _wanted_ranks(ranks, device_num(dst) * stage_count(dst))
    args = (unified, name_to_file, hyper, dst, dst_dir, output_format, wanted, name_map or {}, file_name)
    return _bulk_or_reference(_plan_split_bulk, _plan_split_reference, *args)


def _split_path(dst_dir: str, rank: int, file_name: str, output_format: str) -> str:
    return os.path.join(layout_dir.rank_dir(dst_dir, rank), f"{file_name}.{output_format}")


def _split_params(
    unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], dst_map: Mapping[str, StagedLayout],
    stage: int, name_map: Mapping[str, str],
) -> Iterator[tuple[str, StagedLayout, str, SourceFile]]:
    """(strategy name, layout, file key, source) of every parameter a split writes for ``stage``:
    in the strategy's order, present in its unified file under ``name_map``'s key."""
    for name, staged in dst_map.items():
        if stage not in staged.stages:
            continue
        key = name_map.get(name, name)
        file_id = name_to_file.get(name)
        if file_id is None or file_id not in unified or key not in unified[file_id].tensors:
            continue
        yield name, staged, key, unified[file_id]


def _plan_split_reference(
    unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], hyper: SourceFile | None,
    dst: LayoutTable, dst_dir: str, output_format: str, wanted: Sequence[int], name_map: Mapping[str, str],
    file_name: str,
) -> Plan:
    """``plan_split``, one parameter and rank at a time (the definition; raises the user's errors)."""
    n_dst = device_num(dst)
    interned = _Sources()
    files = []
    for rank in wanted:
        dst_map = layout_map(dst, rank)
        stage = rank // n_dst
        tensors: dict[str, TensorPlan] = {}  # MindSpore's dict order: strategy names, then hyper params
        for name, staged, key, src in _split_params(unified, name_to_file, dst_map, stage, name_map):
            full = src.tensors[key].shape
            box = layout.rank_box(staged.layout, full, rank % n_dst)
            full_box = tuple((0, d) for d in full)
            tensors[name] = _assembled(interned, key, name, [(src, full_box, box)], box, src.tensors[key].dtype)
        if hyper is not None:
            for name in hyper.tensors:
                tensors[name] = _whole(interned, hyper, name)
        path = _split_path(dst_dir, rank, file_name, output_format)
        files.append(FilePlan(path, output_format, tuple(tensors.values()), _meta(output_format), rank))
    return Plan("split", tuple(interned.paths), tuple(files))


def _plan_split_bulk(
    unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], hyper: SourceFile | None,
    dst: LayoutTable, dst_dir: str, output_format: str, wanted: Sequence[int], name_map: Mapping[str, str],
    file_name: str,
) -> Plan | None:
    """``plan_split`` from shared tables, or None where the reference loop must decide.

    The rank-aware layout map (spec 2.4) only depends on which layouts' device counts exceed
    the rank, so templates are keyed by that and the stage.
    """
    n_dst = device_num(dst)
    counts = sorted({p.device_num for p in dst.layouts.values()})
    tables, interned = _Tables(), _Sources()
    templates: dict[tuple[int, tuple[bool, ...]], _Template] = {}
    meta = _meta(output_format)
    files = []
    for rank in wanted:
        key = (rank // n_dst, tuple(rank < n for n in counts))
        template = templates.get(key)
        if template is None:
            template = templates[key] = _split_template(tables, unified, name_to_file, hyper,
                                                        layout_map(dst, rank), rank // n_dst, name_map)
            if template is None:
                return None
        files.append(FilePlan(_split_path(dst_dir, rank, file_name, output_format), output_format,
                              _rank_tensors(template, rank % n_dst, False, interned), meta, rank))
    return Plan("split", tuple(interned.paths), tuple(files))


def _split_template(
    tables: _Tables, unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], hyper: SourceFile | None,
    dst_map: Mapping[str, StagedLayout], stage: int, name_map: Mapping[str, str],
) -> _Template | None:
    """The tensors of a split output for one stage; None for what only the reference loop gets right
    (empty tensors: one empty copy there, none in the tables; a hyper parameter replacing a sliced one)."""
    template = _Template()
    class_index: dict[int, int] = {}
    for name, staged, key, src in _split_params(unified, name_to_file, dst_map, stage, name_map):
        full = src.tensors[key].shape
        if not all(full):
            return None
        cls = tables.get(None, staged.layout, full)
        _add_transformed(template, class_index, cls, name, key, src.tensors[key].dtype, {0: src})
    if hyper is not None:
        if any(name in hyper.tensors for name in (t.name for t in template.transformed)):
            return None
        template.deferred = [(name, {0: hyper}) for name in hyper.tensors]
    template.finish()
    return template


# --------------------------------------------------------------------------------------------
# convert (spec 5): one file to the other format, names optionally mapped


STRING_META_PREFIX = "reshard.str:"  # safetensors cannot hold strings; we keep them in the metadata


def plan_convert(pairs: Sequence[tuple[SourceFile, str, str]], name_map: Mapping[str, str] | None = None) -> Plan:
    """Plan format conversion of whole files: (source, output path, output format) triples.

    MindSpore's ``safetensors_to_ckpt`` writes parameters in sorted-name order (its loader sorts),
    ``ckpt_to_safetensors`` keeps file order (irrelevant: safetensors orders by dtype and name).
    MindSpore cannot convert a ``.ckpt`` holding strings; we store each string in the safetensors
    metadata under ``reshard.str:<name>`` and restore it on the way back. Files without strings get
    exactly MindSpore's bytes.
    """
    interned = _Sources()
    files = []
    rename = dict(name_map or {})
    for src, out_path, out_fmt in pairs:
        from_st = src.path.endswith(".safetensors")
        names = sorted(src.tensors) if out_fmt == "ckpt" and from_st else list(src.tensors)
        tensors: list[TensorPlan] = []
        meta: dict[str, str] = {"format": "ms"} if out_fmt == "safetensors" else {}
        strings = _metadata_strings(src) if out_fmt == "ckpt" and from_st else {}
        for name in sorted(set(names) | set(strings)) if strings else names:
            out = rename.get(name, name)
            if name in strings:
                raw = strings[name].encode("utf-32-le")
                tensors.append(TensorPlan(out, dtypes.STR, (0,), (), len(raw), raw))
            elif src.tensors[name].dtype is dtypes.STR and out_fmt == "safetensors":
                meta[STRING_META_PREFIX + out] = src.strings[name]
            else:
                tensors.append(_whole(interned, src, name, out))
        files.append(FilePlan(out_path, out_fmt, tuple(tensors), tuple(meta.items())))
    return Plan("convert", tuple(interned.paths), tuple(files))


def _metadata_strings(src: SourceFile) -> dict[str, str]:
    return {k[len(STRING_META_PREFIX):]: v for k, v in src.metadata.items() if k.startswith(STRING_META_PREFIX)}


# --------------------------------------------------------------------------------------------
# Hugging Face sharded safetensors (see reshard.formats.hf_index for the rules and their source)

_ONE_PART = 2**63  # plan_unify's part size that packs every tensor into part0


def plan_hf_shards(
    tensors: Sequence[TensorPlan],
    dst_dir: str,
    max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE,
    metadata: Sequence[tuple[str, str]] = (),
) -> tuple[tuple[FilePlan, ...], tuple[TextOutput, ...]]:
    """Full-model tensors as Hugging Face shards in ``dst_dir``, and the index (none for one shard).

    Tensors keep the given order (that order decides the shards); ``metadata`` (e.g. the strings
    a ``.ckpt`` held) goes into the first shard, after ``{"format": "pt"}``.
    """
    for t in tensors:
        if t.dtype is dtypes.STR:
            raise UnsupportedError(f"{t.name!r} is a string; Hugging Face shards hold tensors only")
    by_name = {t.name: t for t in tensors}
    groups = hf_index.shard_groups([(t.name, t.nbytes) for t in tensors], max_shard_size) or [[]]
    names = hf_index.shard_names(len(groups))
    files = []
    for j, (group, file_name) in enumerate(zip(groups, names, strict=True)):
        meta = (*hf_index.SHARD_METADATA, *(metadata if j == 0 else ()))
        files.append(FilePlan(os.path.join(dst_dir, file_name), "safetensors",
                              tuple(by_name[n] for n in group), meta))
    if len(groups) == 1:
        return tuple(files), ()
    weight_map = {n: file_name for group, file_name in zip(groups, names, strict=True) for n in group}
    text = hf_index.index_text(sum(t.nbytes for t in tensors), weight_map)
    return tuple(files), (TextOutput(os.path.join(dst_dir, hf_index.INDEX_NAME), text),)


def hf_sharded(plan: Plan, dst_dir: str, max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE) -> Plan:
    """``plan`` with its one full-model output written as Hugging Face shards in ``dst_dir`` instead.

    Strings that a safetensors output keeps in its metadata (``reshard.str:<name>``) stay in the
    first shard's metadata; other metadata (``format: ms``) is replaced by ``format: pt``.
    """
    if len(plan.files) != 1:
        raise UsageError(f"Hugging Face output needs one full-model file, but this {plan.operation} writes "
                         f"{len(plan.files)}")
    (full,) = plan.files
    strings = tuple((k, v) for k, v in full.metadata if k.startswith(STRING_META_PREFIX))
    files, texts = plan_hf_shards(tuple(full.tensors), dst_dir, max_shard_size, strings)
    return Plan(plan.operation, plan.sources, files, (*plan.texts, *texts), plan.notes)


def plan_unify_hf(
    sources: Mapping[int, SourceFile],
    src: LayoutTable,
    dst_dir: str,
    choice_func: ChoiceFunc | None = None,
    max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE,
) -> Plan:
    """``plan_unify`` with the full tensors as Hugging Face shards + index instead of parts.

    The same tensors as ``unified_safetensors`` (same choice, same renames), in the order they
    first appear in the rank files (rank order); the parameters outside the strategy stay in
    ``hyper_param.safetensors`` beside the shards, outside the index, as in a unified folder.
    """
    whole = plan_unify(sources, src, dst_dir, choice_func, (), part_bytes=_ONE_PART)
    part0 = os.path.join(dst_dir, "part0.safetensors")
    (part,) = [f for f in whole.files if f.path == part0]
    others = tuple(f for f in whole.files if f.path != part0)
    order: dict[str, int] = {}
    for f in sources.values():
        for name in f.tensors:
            order.setdefault(name, len(order))

    def position(t: TensorPlan) -> int:
        return order.get(t.copies[0].tensor if t.copies else t.name, len(order))

    files, texts = plan_hf_shards(sorted(part.tensors, key=position), dst_dir, max_shard_size)
    return Plan("unify", whole.sources, (*files, *others), texts)


def plan_transform_full(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst: LayoutTable | None,
    dst_dir: str,
    prefix: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """``plan_transform`` from a full model spread over several files (a Hugging Face sharded model).

    Each name's tensor comes from ``unified[name_to_file[name]]``; names are taken in the map's
    order. With a destination strategy this is exactly a transform of the same tensors held in
    one full file (same tensors, order and errors: names outside the strategy are copied whole to
    every rank); without one, every tensor is copied whole into ``rank_0`` (joining the shards).
    Planned from shared tables like ``plan_split``; anything unusual goes to the reference loop.
    """
    planner = TransformPlanner({}, None, dst)
    wanted = _wanted_ranks(ranks, planner.dst_total)
    args = (planner, unified, name_to_file, dst_dir, prefix, output_format, wanted)
    bulk = _plan_transform_full_bulk if dst is not None else None
    return _bulk_or_reference(bulk, _plan_transform_full_reference, *args)


def _plan_transform_full_reference(
    planner: TransformPlanner, unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], dst_dir: str,
    prefix: str, output_format: str, wanted: Sequence[int],
) -> Plan:
    """``plan_transform_full`` one parameter and rank at a time (``TransformPlanner.plan_rank``'s loop)."""
    interned = _Sources()
    files = []
    for rank in wanted:
        dst_map = planner.dst_map(rank)
        if dst_map is None:
            tensors = tuple(_whole(interned, unified[f], name) for name, f in name_to_file.items())
        else:
            cut = _stage_cut(None, dst_map, rank // planner.n_dst)
            transformed: list[TensorPlan] = []
            deferred: list[str] = []
            for name, file_id in name_to_file.items():
                if not cut.keeps(name):
                    continue
                if not cut.transforms(name):
                    deferred.append(name)
                    continue
                transformed.append(planner._transform_one(name, None, dst_map[name].layout, {0: unified[file_id]},
                                                          rank % planner.n_dst, interned))
            if not transformed:
                raise LayoutError("none of the checkpoint's parameters is in the source or destination strategy")
            tensors = (*transformed, *(_whole(interned, unified[name_to_file[n]], n) for n in deferred))
        path = layout_dir.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, tuple(tensors), _meta(output_format), rank))
    return Plan("transform", tuple(interned.paths), tuple(files))


def _plan_transform_full_bulk(
    planner: TransformPlanner, unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str], dst_dir: str,
    prefix: str, output_format: str, wanted: Sequence[int],
) -> Plan | None:
    """``plan_transform_full`` from shared tables (one template per destination stage), or None."""
    tables, interned = _Tables(), _Sources()
    templates: dict[int, _Template | None] = {}
    files = []
    for rank in wanted:
        stage = rank // planner.n_dst
        if stage not in templates:
            dst_map = planner.dst_map(rank)
            assert dst_map is not None  # the reference path plans a transform without destination strategy
            templates[stage] = _full_template(tables, unified, name_to_file, dst_map, stage)
        template = templates[stage]
        if template is None:
            return None
        path = layout_dir.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, _rank_tensors(template, rank % planner.n_dst, False, interned),
                              _meta(output_format), rank))
    return Plan("transform", tuple(interned.paths), tuple(files))


def _full_template(
    tables: _Tables, unified: Mapping[str, SourceFile], name_to_file: Mapping[str, str],
    dst_map: Mapping[str, StagedLayout], stage: int,
) -> _Template | None:
    """The tensors of one destination stage; None where the reference loop must decide (empty
    tensors, or nothing to transform: it raises the error)."""
    cut = _stage_cut(None, dict(dst_map), stage)
    template = _Template()
    class_index: dict[int, int] = {}
    for name, file_id in name_to_file.items():
        src = unified[file_id]
        if not cut.keeps(name):
            continue
        if not cut.transforms(name):
            template.deferred.append((name, {0: src}))
            continue
        t = src.tensors[name]
        if not all(t.shape):
            return None
        cls = tables.get(None, dst_map[name].layout, t.shape)
        _add_transformed(template, class_index, cls, name, name, t.dtype, {0: src})
        template.device_n = 1  # a full source: one device
    if template.device_n is None:
        return None
    template.finish()
    return template
