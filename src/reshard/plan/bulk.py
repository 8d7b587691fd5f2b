"""Transform and split plans in bulk: shared per-class tables and lazily built tensor lists.

Planning 1 000 parameters for 1 024 ranks must take well under a second, but a million
``TensorPlan`` objects alone take seconds to build. So transform and split plans are built in
bulk and lazily:

* **Classes.** Parameters sharing (source layout, destination layout, full shape) share one
  ``LayoutClass``: the layout engine's tables for all ranks (``layout.transfer_table``,
  ``layout.rank_boxes``) and, per destination rank, the copies relative to the box origins.
* **Templates.** Everything a destination rank's file depends on except the rank itself (tensor
  order, each tensor's class and candidate source files) is decided once per (load order, stage)
  in a ``Template``; source files are checked against the real slice shapes once per (class,
  source rank), not per destination rank.
* **Lazy files.** ``FilePlan.tensors`` of such plans is a ``RankTensors`` sequence that builds its
  ``TensorPlan`` objects when iterated (executors take one file at a time) and answers totals
  (``FileStats``: counts, bytes) arithmetically, so ``Plan.summary()`` builds nothing. The few
  files built last stay cached in the planning run's ``BuiltFiles``, not in the process.
* **One definition.** The plain per-parameter loops (``TransformPlanner.plan_rank`` in
  ``reshard.plan.transform``, the split and full-model reference loops) stay the definition: the
  bulk path falls back to them whenever anything is off, so every error message is the one they
  raise, and the tests check that both paths give equal plans.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard import layout
from reshard.dtypes import DType
from reshard.errors import LayoutError, ReshardError, UsageError
from reshard.formats import rank_dirs
from reshard.layout import LayoutTable, ParamLayout, StagedLayout
from reshard.plan.model import (
    Copy,
    FilePlan,
    FileStats,
    LazyTensors,
    Plan,
    Role,
    SourceFile,
    SourcePaths,
    TensorPlan,
    box_start,
    output_metadata,
    read_bytes,
    wanted_ranks,
    whole_tensor_at,
)
from reshard.plan.transform import StageCut, TransformPlanner, redundant_copy

CopyShape = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]  # key, src/dst start, lengths, whole
FEW_RANKS_SHARE = 4  # planning at most a quarter of a stage's ranks: per-rank pieces, not whole tables
MATERIALISED_FILES = 8  # files whose TensorPlans stay built: the ones an executor has in flight, not the plan


@dataclass(frozen=True)
class RankShare:
    """One destination rank's share of one class: its box and copies, relative to the origins."""

    shape: tuple[int, ...]
    copies: tuple[CopyShape, ...]
    keys: tuple[int, ...]  # source key of each copy, in copy order
    key_set: frozenset[int]
    elements: int
    read_elements: int  # sum of the copies' volumes


class LayoutClass:
    """One (source layout, destination layout, full shape): the layout engine's answer for all ranks.

    Parameters sharing it share every tuple a ``Copy`` holds; per destination rank only the
    source file (hence the source index) and the tensor name differ.
    """

    def __init__(
        self, src_p: ParamLayout | None, dst_p: ParamLayout | None, full: tuple[int, ...], few: bool = False
    ) -> None:
        self.src_p, self.dst_p, self.full = src_p, dst_p, full
        self.dst_boxes = layout.rank_boxes(dst_p, full)  # first, as plan_rank asks for the box first
        # ``few`` (a plan of a few destination ranks, e.g. one node's): each rank's pieces alone,
        # not the table of every rank (the same pieces: the table is made of them).
        self.table = None if few else layout.transfer_table(src_p, dst_p, full, any_device_num=True)
        self.src_boxes = layout.rank_boxes(src_p, full)
        self._shares: dict[int, RankShare] = {}

    def share(self, rank: int) -> RankShare:
        hit = self._shares.get(rank)
        if hit is None:
            if not 0 <= rank < len(self.dst_boxes):
                raise LayoutError(f"rank {rank} is outside the {len(self.dst_boxes)} devices of the destination layout")
            hit = self._shares[rank] = self._relative(rank)
        return hit

    def _pieces(self, rank: int) -> tuple[layout.Piece, ...] | list[layout.Piece]:
        if self.table is not None:
            return self.table[rank]
        return layout.transfer_pieces(self.src_p, self.dst_p, self.full, rank, any_device_num=True)

    def _relative(self, rank: int) -> RankShare:
        dst_origin = box_start(self.dst_boxes[rank])
        copies: list[CopyShape] = []
        for key, piece in self._pieces(rank):
            held = self.src_boxes[key]
            lengths = tuple(b - a for a, b in piece)
            start = box_start(piece)
            copies.append(
                (
                    key,
                    tuple(a - o for a, o in zip(start, box_start(held), strict=True)),
                    tuple(a - o for a, o in zip(start, dst_origin, strict=True)),
                    lengths,
                    lengths == tuple(b - a for a, b in held),
                )
            )
        shape = tuple(b - a for a, b in self.dst_boxes[rank])
        keys = tuple(c[0] for c in copies)
        return RankShare(
            shape, tuple(copies), keys, frozenset(keys), math.prod(shape), sum(math.prod(c[3]) for c in copies)
        )


class Transformed:
    """One transformed parameter of a template (a slotted class: templates hold one per parameter)."""

    __slots__ = ("cls", "dtype", "files", "held_by", "name", "tensor")

    def __init__(self, name: str, tensor: str, cls: int, dtype: DType, held_by: dict[int, SourceFile]) -> None:
        self.name = name  # in the output
        self.tensor = tensor  # in the source files (differs when a split renames keys)
        self.cls = cls  # index into Template.classes
        self.dtype = dtype
        self.held_by = held_by  # source key -> file, as the load order leaves it
        self.files = held_by  # the same plus redundant copies found for missing keys (copied on first write)

    def add_file(self, key: int, src: SourceFile) -> None:
        if self.files is self.held_by:
            self.files = dict(self.held_by)
        self.files[key] = src


class Template:
    """What one (load order, stage) decides for every destination rank sharing it.

    The output's tensor order, each tensor's class and candidate source files, and which
    (class, source key) combinations were already checked against the files' real shapes.
    """

    def __init__(self) -> None:
        self.transformed: list[Transformed] = []
        self.classes: list[LayoutClass] = []
        self.members: list[list[Transformed]] = []  # per class
        self.checked: list[set[int]] = []  # per class: source keys resolved for every member
        self.deferred: list[tuple[str, dict[int, SourceFile]]] = []  # copied whole (not in both strategies)
        self.device_n: int | None = None  # the last transformed parameter's source device count [MindSpore]
        self.groups: tuple[tuple[int, int, DType], ...] = ()  # (class, parameters, dtype) for totals
        self._counts: dict[tuple[int, int], list] = {}  # (class, id(dtype)) -> [count, dtype]
        self._class_index: dict[int, int] = {}  # id(LayoutClass) -> index in classes
        self.wholes: dict[tuple[int, bool], tuple[tuple[SourceFile, ...], FileStats]] = {}
        self.orders: dict[tuple[object, ...], tuple[str, ...]] = {}  # source paths in first-use order
        self._plains: dict[int, tuple[dict[int, SourceFile], bool]] = {}  # id -> (files, no virtual file)

    def add(self, cls: LayoutClass, name: str, tensor: str, dtype: DType, held_by: dict[int, SourceFile]) -> None:
        """Parameter ``name`` (``tensor`` in its source files) of class ``cls``, next in the output."""
        index = self._class_index.setdefault(id(cls), len(self._class_index))
        t = Transformed(name, tensor, index, dtype, held_by)
        if index == len(self.classes):
            self.classes.append(cls)
            self.members.append([])
            self.checked.append(set())
        self.members[index].append(t)
        self.transformed.append(t)
        group = self._counts.get((index, id(dtype)))
        if group is None:
            self._counts[(index, id(dtype))] = [1, dtype]
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
                src = t.held_by.get(key)
                if src is not None:  # the common case: the file is in the load order
                    if src.tensors[t.tensor].shape != lengths:
                        raise LayoutError(f"no source file holds the slice of source rank {key} of {t.name!r}")
                    continue
                src = redundant_copy(cls.src_p, cls.full, held, t.held_by)
                if src is None or src.tensors[t.tensor].shape != lengths:
                    raise LayoutError(f"no source file holds the slice of source rank {key} of {t.name!r}")
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
                read += read_bytes(t.dtype, t.shape, math.prod(t.shape), t.nbytes)
                written += t.nbytes
                largest = max(largest, t.nbytes)
            n = len(files)
            hit = self.wholes[(key, beyond)] = (tuple(files), FileStats(n, n, read, written, largest))
        return hit

    def _plain(self, files: dict[int, SourceFile]) -> bool:
        """Whether no file of ``files`` is virtual (each holds all its tensors itself)."""
        hit = self._plains.get(id(files))
        if hit is None:
            hit = self._plains[id(files)] = (files, all(not f.homes for f in files.values()))
        return hit[1]

    def source_order(self, shares: tuple[RankShare, ...], wholes: tuple[SourceFile, ...]) -> tuple[str, ...]:
        """Source paths of one rank in first-use order (what per-tensor interning would produce)."""
        key = (tuple(share.keys for share in shares), id(wholes))
        hit = self.orders.get(key)
        if hit is None:
            seen: dict[str, None] = {}
            # Parameters of one class reading the same files (one dict, shared from the holders)
            # add nothing after the first, unless a file is virtual (its paths differ per tensor).
            done: set[tuple[int, int]] = set()
            for t in self.transformed:
                files = t.files
                if (t.cls, id(files)) in done:
                    continue
                for k in shares[t.cls].keys:
                    seen[files[k].path_of(t.tensor)] = None
                if self._plain(files):
                    done.add((t.cls, id(files)))
            for (name, _), f in zip(self.deferred, wholes, strict=True):
                seen[f.path_of(name)] = None
            hit = self.orders[key] = tuple(seen)
        return hit


class BuiltFiles:
    """The ``TensorPlan`` tuples of the last few files a planning run's outputs built (an LRU).

    Owned by one planning run and shared by its ``RankTensors``, so an executor iterating a file
    several times builds it once, and nothing outlives the plan.
    """

    def __init__(self, size: int = MATERIALISED_FILES) -> None:
        self.size = size
        self._serials = itertools.count()
        self._built: OrderedDict[int, tuple[TensorPlan, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._built)

    def serial(self) -> int:
        """A new key for one file."""
        return next(self._serials)

    def get(self, serial: int) -> tuple[TensorPlan, ...] | None:
        with self._lock:
            hit = self._built.get(serial)
            if hit is not None:
                self._built.move_to_end(serial)
            return hit

    def put(self, serial: int, built: tuple[TensorPlan, ...]) -> None:
        with self._lock:
            self._built[serial] = built
            while len(self._built) > self.size:
                self._built.popitem(last=False)


class RankTensors(LazyTensors):
    """The tensors of one transform output, built on access from shared per-class tables.

    A 1 000-parameter x 1 024-rank plan would otherwise hold a million ``TensorPlan`` objects
    before the first byte moves; executors look at one file at a time. Totals (``stats``) come
    from the tables without building anything. The last few built files stay cached in the
    planning run's ``BuiltFiles``, so an executor iterating a file several times builds it once.
    Pickling (Ray) and equality see a plain tuple of ``TensorPlan``.
    """

    def __init__(
        self,
        template: Template,
        shares: tuple[RankShare, ...],
        wholes: tuple[SourceFile, ...],
        whole_stats: FileStats,
        ids: Mapping[str, int],
        built: BuiltFiles,
    ) -> None:
        self.template = template
        self.shares = shares  # per class of the template
        self._wholes = wholes
        self._whole_stats = whole_stats
        self._ids = ids  # source path -> index in Plan.sources (complete once planning ends)
        self.built = built
        self._serial = built.serial()
        self._stats: FileStats | None = None

    def __len__(self) -> int:
        return len(self.template.transformed) + len(self._wholes)

    @property
    def stats(self) -> FileStats:
        if self._stats is None:
            copies = read = written = largest = 0
            for index, count, dtype in self.template.groups:
                share = self.shares[index]
                nbytes = share.elements * dtype.itemsize
                copies += count * len(share.copies)
                read += count * read_bytes(dtype, share.shape, share.read_elements, nbytes)
                written += count * nbytes
                largest = max(largest, nbytes)
            w = self._whole_stats
            self._stats = FileStats(
                len(self),
                copies + w.copies,
                read + w.bytes_read,
                written + w.bytes_written,
                max(largest, w.largest_tensor),
            )
        return self._stats

    def entries(self) -> tuple[tuple[str, DType, tuple[int, ...]], ...]:
        """(name, dtype, shape) of every output tensor in file order, without building any ``TensorPlan``."""
        shares = self.shares
        out = [(t.name, t.dtype, shares[t.cls].shape) for t in self.template.transformed]
        for (name, _), src in zip(self.template.deferred, self._wholes, strict=True):
            t = src.tensors[name]
            out.append((name, t.dtype, t.shape))
        return tuple(out)

    def stats_of(self, indices: Sequence[int]) -> FileStats:
        """Totals of the tensors at ``indices`` (positions in file order), without building them."""
        copies = read = written = largest = 0
        transformed, shares = self.template.transformed, self.shares
        for i in indices:
            if i < len(transformed):
                t = transformed[i]
                share = shares[t.cls]
                nbytes = share.elements * t.dtype.itemsize
                copies += len(share.copies)
                read += read_bytes(t.dtype, share.shape, share.read_elements, nbytes)
            else:
                name = self.template.deferred[i - len(transformed)][0]
                src = self._wholes[i - len(transformed)].tensors[name]
                nbytes = src.nbytes
                copies += 1
                read += read_bytes(src.dtype, src.shape, math.prod(src.shape), src.nbytes)
            written += nbytes
            largest = max(largest, nbytes)
        return FileStats(len(indices), copies, read, written, largest)

    def materialise(self) -> tuple[TensorPlan, ...]:
        """The ``TensorPlan`` tuple (built, or taken from the cache of recently built files)."""
        hit = self.built.get(self._serial)
        if hit is not None:
            return hit
        built = self._build()
        self.built.put(self._serial, built)
        return built

    def _build(self) -> tuple[TensorPlan, ...]:
        ids, shares = self._ids, self.shares
        out: list[TensorPlan] = []
        for t in self.template.transformed:
            share, files, tensor = shares[t.cls], t.files, t.tensor
            copies = tuple(Copy(ids[files[k].path_of(tensor)], tensor, s, d, n, w) for k, s, d, n, w in share.copies)
            out.append(TensorPlan(t.name, t.dtype, share.shape, copies, share.elements * t.dtype.itemsize))
        for (name, _), src in zip(self.template.deferred, self._wholes, strict=True):
            out.append(whole_tensor_at(ids[src.path_of(name)], src, name))
        return tuple(out)


class Tables:
    """The classes of one planning run, by (source layout, destination layout, full shape).

    Looked up once per parameter and template, so the first lookup is by the layouts' identity
    (hashing and comparing frozen layouts field by field costs more than the rest of a lookup);
    equal layouts held by different objects still share one class through the second. Every
    layout looked up by identity stays referenced by the entry, so its id cannot be reused.
    """

    def __init__(self, few: bool = False) -> None:
        self.few = few  # a plan of a few destination ranks: classes compute only the ranks asked for
        self._classes: dict[tuple[ParamLayout | None, ParamLayout | None, tuple[int, ...]], LayoutClass] = {}
        self._by_id: dict[
            tuple[int, int, tuple[int, ...]], tuple[ParamLayout | None, ParamLayout | None, LayoutClass]
        ] = {}
        self._fulls: dict[tuple[int, tuple[int, ...]], tuple[ParamLayout, tuple[int, ...]]] = {}
        self._full_values: dict[tuple[ParamLayout, tuple[int, ...]], tuple[int, ...]] = {}

    def full(self, src_p: ParamLayout | None, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``layout.full_shape``, once per (layout, slice shape)."""
        if src_p is None:
            return shape
        hit = self._fulls.get((id(src_p), shape))
        if hit is None:
            # Equal layouts held by different objects (one per parameter, as read from a file)
            # share one answer: comparing frozen layouts costs less than the slice algebra.
            full = self._full_values.get((src_p, shape))
            if full is None:
                full = self._full_values[(src_p, shape)] = layout.full_shape(src_p, shape)
            hit = self._fulls[(id(src_p), shape)] = (src_p, full)
        return hit[1]

    def get(self, src_p: ParamLayout | None, dst_p: ParamLayout | None, full: tuple[int, ...]) -> LayoutClass:
        hit = self._by_id.get((id(src_p), id(dst_p), full))
        if hit is None:
            cls = self._classes.get((src_p, dst_p, full))
            if cls is None:
                cls = self._classes[(src_p, dst_p, full)] = LayoutClass(src_p, dst_p, full, self.few)
            hit = self._by_id[(id(src_p), id(dst_p), full)] = (src_p, dst_p, cls)
        return hit[2]


def rank_tensors(template: Template, local: int, beyond: bool, sources: SourcePaths, built: BuiltFiles) -> RankTensors:
    """One destination rank's lazy tensors: its share of every class, its files checked, its sources interned."""
    shares = tuple(cls.share(local) for cls in template.classes)
    for index, share in enumerate(shares):
        if not share.key_set <= template.checked[index]:
            template.resolve(index, share.key_set)
    device_n = template.device_n if template.device_n is not None else 1
    wholes, whole_stats = template.whole(local % device_n, beyond)
    for path in template.source_order(shares, wholes):
        sources.id(path)
    return RankTensors(template, shares, wholes, whole_stats, sources.ids, built)


def bulk_or_reference(bulk: Callable[..., Plan | None] | None, reference: Callable[..., Plan], *args: Any) -> Plan:
    """The fast planner's plan, or the reference loop's where the fast one declines or meets an error
    (the reference loop is the definition: it raises the precise, blamed error)."""
    try:
        plan = bulk(*args) if bulk is not None else None
    except ReshardError:
        plan = None
    return plan if plan is not None else reference(*args)


# --------------------------------------------------------------------------------------------
# transform (docs/formats.md §3.6, §3.9, §4.2)

# A parameter's memo in a destination stage: its role and, to transform, (src layout, dst layout, src devices).
_Decision = tuple[Role, ParamLayout | None, ParamLayout | None, int]


class _BulkPlanner:
    """``plan_transform``'s fast path over a ``TransformPlanner``: same plans, built from tables.

    Per destination rank it only looks up a template (by load order and stage), one ``RankShare``
    per class and the source files not yet checked; ``TensorPlan`` objects are left to
    ``RankTensors``. Whenever anything is wrong the rank is planned again by the reference path
    (``TransformPlanner.plan_rank``), which raises the exact error a user should see, naming the
    parameter and the strategy file; the fast path's own errors are only a signal.
    """

    def __init__(self, planner: TransformPlanner, few: bool = False) -> None:
        self.planner = planner
        self.sources = SourcePaths()
        self.tables = Tables(few)
        self.built = BuiltFiles()
        self._templates: dict[tuple[tuple[int, ...], int, bool], Template] = {}
        self._stages: dict[int, tuple[dict[str, _Decision], StageCut, dict[str, StagedLayout] | None]] = {}

    def rank(self, rank: int) -> RankTensors:
        p = self.planner
        order = p.needed(rank)
        missing = [r for r in order if r not in p.files]
        if missing:
            raise UsageError(
                f"destination rank {rank} needs the checkpoint of source rank(s) "
                f"{', '.join(map(str, sorted(missing)))}, which is missing"
            )
        beyond = rank in p.beyond
        try:
            template = self._template(tuple(order), rank // p.n_dst, beyond)
            return rank_tensors(template, rank % p.n_dst, beyond, self.sources, self.built)
        except ReshardError:
            p.plan_rank(rank, SourcePaths(), order)  # raises the precise, blamed error
            raise

    def _template(self, order: tuple[int, ...], stage: int, beyond: bool) -> Template:
        hit = self._templates.get((order, stage, beyond))
        if hit is None:
            hit = self._templates[(order, stage, beyond)] = self._build_template(order, stage, beyond)
        return hit

    def _build_template(self, order: tuple[int, ...], stage: int, beyond: bool) -> Template:
        """``plan_rank``'s loop over parameters, minus everything that depends on the rank."""
        p = self.planner
        holders = p.holders(order, beyond)
        decisions, cut, dst_map = self._stage(stage)
        template = Template()
        tables = self.tables
        for name, by_key in holders.items():
            decision = decisions.get(name)
            if decision is None:
                decision = decisions[name] = self._decide(name, cut, dst_map)
            role, src_p, dst_p, device_n = decision
            if role is Role.SKIP:
                continue
            if role is Role.WHOLE:
                template.deferred.append((name, by_key))
                continue
            template.device_n = device_n
            first = next(iter(by_key.values())).tensors[name]
            template.add(tables.get(src_p, dst_p, tables.full(src_p, first.shape)), name, name, first.dtype, by_key)
        if template.device_n is None:
            raise LayoutError("no parameter to transform")
        template.finish()
        return template

    def _stage(self, stage: int) -> tuple[dict[str, _Decision], StageCut, dict[str, StagedLayout] | None]:
        """A destination stage's cut and layout map, and a memo of what ``plan_rank`` does with each name."""
        hit = self._stages.get(stage)
        if hit is None:
            p = self.planner
            rank = stage * p.n_dst
            hit = self._stages[stage] = ({}, p.stage_cut(rank), p.dst_map(rank))
        return hit

    def _decide(self, name: str, cut: StageCut, dst_map: dict[str, StagedLayout] | None) -> _Decision:
        role = cut.role(name)
        if role is not Role.TRANSFORM:
            return role, None, None, 0
        src_p, dst_p = self.planner.layouts(name, dst_map)
        return role, src_p, dst_p, src_p.device_num if src_p is not None else 1


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
    wanted = wanted_ranks(ranks, planner.dst_total)
    if ranks is None:
        planner.check_rank_count()
    else:
        planner.check_needed_present(wanted)
    planner.check_agreement()
    bulk = _BulkPlanner(planner, few=ranks is not None and len(wanted) * FEW_RANKS_SHARE <= planner.n_dst)
    meta = output_metadata(output_format)
    files = []
    for rank in wanted:
        path = rank_dirs.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, bulk.rank(rank), meta, rank))
    read = tuple(bulk.sources.paths)
    keep = () if ranks is None else tuple(planner.stage_representatives(wanted, read))
    plan = Plan("transform", read + keep, tuple(files))
    if planner.stood_in:
        planner.check_reads(plan.sources, ((f.rank, f.tensors) for f in plan.files))
    return plan


__all__ = [
    "MATERIALISED_FILES",
    "BuiltFiles",
    "LayoutClass",
    "RankShare",
    "RankTensors",
    "Tables",
    "Template",
    "Transformed",
    "bulk_or_reference",
    "plan_transform",
    "rank_tensors",
]
