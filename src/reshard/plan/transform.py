"""Transform plans, one parameter and rank at a time: the definition every faster path answers to.

``TransformPlanner`` reproduces MindSpore's ``transform_checkpoints`` (all-stage mode) and
``transform_checkpoint_by_rank``: which parameters a destination file holds and in which order
(docs/formats.md §3.6, §3.9), which source ranks a destination rank needs and in which order they are loaded
(docs/formats.md §3.7), and which redundant source copy supplies each element (docs/formats.md §3.5); the layout
arithmetic itself is ``reshard.layout``'s. What a destination file does with each parameter
(leave it out, copy it whole, or reslice it) is decided in one place, ``StageCut.role``.

The plain per-parameter loop (``TransformPlanner.plan_rank``) is slow for 1 000 parameters x
1 024 ranks, so ``reshard.plan.bulk`` plans from shared tables instead; it falls back to this loop
whenever anything is off, so every error message is the one raised here, naming the parameter
and the strategy file, and the tests check that both paths give equal plans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from reshard import layout
from reshard.dtypes import DType
from reshard.errors import LayoutError, UsageError
from reshard.formats import rank_dirs
from reshard.layout import (
    Box,
    LayoutTable,
    ParamLayout,
    StagedLayout,
    device_num,
    has_shared_names,
    layout_map,
    stage_count,
)
from reshard.plan.agree import Agreement, check_agreement
from reshard.plan.model import (
    FilePlan,
    Plan,
    Role,
    SourceFile,
    SourcePaths,
    TensorPlan,
    assembled,
    output_metadata,
    rank_ranges,
    whole_tensor,
)


@dataclass(frozen=True)
class StageCut:
    """Which names a destination rank keeps, and how (docs/formats.md §3.7/§3.9 stage filtering)."""

    src: Mapping[str, StagedLayout] | None
    dst: Mapping[str, StagedLayout] | None
    dropped: frozenset[str]  # destination parameters of other stages

    def role(self, name: str) -> Role:
        """Leave ``name`` out (another stage's), copy it whole (in only one strategy), or transform it."""
        src, dst, dropped = self.src, self.dst, self.dropped
        if src is None and dst is None:  # full model to full model: every name is copied as it is
            return Role.TRANSFORM
        in_src = src is None or name in src
        in_dst = dst is None or name in dst
        if in_src and in_dst and name not in dropped:
            return Role.TRANSFORM
        not_local_src = src is None or (in_src and name in dropped)
        not_local_dst = dst is None or name in dropped
        return Role.SKIP if not_local_src and not_local_dst else Role.WHOLE

    def sort(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """``names`` to transform and to copy whole, each in order; the skipped ones left out."""
        transform: list[str] = []
        whole: list[str] = []
        for name in names:
            role = self.role(name)
            if role is not Role.SKIP:
                (transform if role is Role.TRANSFORM else whole).append(name)
        return transform, whole


def stage_cut(
    src_map: Mapping[str, StagedLayout] | None, dst_map: Mapping[str, StagedLayout] | None, stage: int
) -> StageCut:
    dropped = frozenset(n for n, s in (dst_map or {}).items() if stage not in s.stages)
    return StageCut(src_map, dst_map, dropped)


class TransformPlanner:
    """Plans MindSpore's ``transform_checkpoints`` (all-stage mode) for any set of destination ranks."""

    def __init__(self, sources: Mapping[int, SourceFile], src: LayoutTable | None, dst: LayoutTable | None):
        self.files = dict(sources)
        self.src = src
        self.dst = dst
        self.src_map = layout_map(src) if src is not None else None
        self.n_src = device_num(src, self.src_map) if src is not None else 1
        dst_base = layout_map(dst) if dst is not None else None
        self.n_dst = device_num(dst, dst_base) if dst is not None else 1
        self.dst_total = self.n_dst * stage_count(dst, dst_base) if dst is not None else 1
        self._dst_maps: dict[int, dict[str, StagedLayout]] = {}
        # Without parameters shared by stages the rank-aware map is the same for every rank.
        self._dst_base = dst_base if dst is not None and not has_shared_names(dst, dst_base or {}) else None
        self.beyond: set[int] = set()  # destination ranks planned beyond what MindSpore can do
        self._shared: dict[str, int] | None = None  # see _own_stages
        self.stood_in: dict[int, SourceFile] = {}  # absent source ranks planned from a peer's header

    def _src_stages(self) -> int:
        return stage_count(self.src, self.src_map) if self.src is not None else 1

    def check_rank_count(self) -> None:
        """The source strategy must describe exactly the rank folders present."""
        expected = self.n_src * self._src_stages()
        found = sorted(self.files)
        if found != list(range(expected)):
            where = self.src.path if self.src is not None else None
            missing = sorted(set(range(expected)) - set(found))
            if found and missing and found[-1] < expected:  # the strategy is right; rank folders are missing
                folder = os.path.dirname(os.path.dirname(self.files[found[0]].path))
                raise UsageError(
                    f"no folder for rank(s) {rank_ranges(missing)}: the source strategy describes {expected} ranks "
                    f"(0..{expected - 1}), the checkpoint has rank folders {rank_ranges(found)}",
                    folder,
                )
            raise LayoutError(
                f"the source strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint has "
                f"{len(found)} rank folder(s) ({rank_ranges(found)})",
                where,
            )

    def check_agreement(self) -> Agreement | None:
        """The source files and the source strategy tell one story (``reshard.plan.agree``), checked
        before any plan is made from them; None without a source strategy (full tensors)."""
        if self.src is None:
            return None
        return check_agreement(self.files, self.src, self.n_src)

    def check_needed_present(self, wanted: Sequence[int]) -> None:
        """With chosen destination ranks (a node without a shared disk), only the source ranks they
        need must be present; every rank folder present must still be one the strategy describes.

        MindSpore's needed list holds every redundant copy (64 source ranks for one destination rank
        of a 4 096 -> 1 024 job) while the plan reads one copy of each element (4 of them). A needed
        rank that is absent is stood in for (``stand_in_missing``) when that is exact; the plan must
        then read none of the stand-ins (``check_reads``).
        """
        expected = self.n_src * self._src_stages()
        extra = [r for r in sorted(self.files) if r >= expected]
        if extra:
            where = self.src.path if self.src is not None else None
            raise LayoutError(
                f"the source strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint has "
                f"rank folder(s) {rank_ranges(extra)}",
                where,
            )
        for rank in wanted:
            missing = [r for r in sorted(self.needed(rank)) if r not in self.files]
            if missing and not self.stand_in_missing(missing):
                self._missing_error(rank, missing)

    def _rank_folder(self, r: int) -> str:
        base = os.path.dirname(os.path.dirname(next(iter(self.files.values())).path)) if self.files else ""
        return os.path.join(base, f"rank_{r}")

    def _missing_error(self, rank: int, missing: Sequence[int]) -> None:
        r = missing[0]
        others = f" (also missing: {rank_ranges(missing[1:])})" if len(missing) > 1 else ""
        raise UsageError(f"rank {r} is needed by destination rank {rank} but {self._rank_folder(r)} is missing{others}")

    def stand_in_missing(self, missing: Sequence[int]) -> bool:
        """Stand in for absent source ranks with a present rank of the same stage, if that is exact.

        It is exact when every present file of that stage holds the same names with the same
        dtypes and shapes: then an absent rank's file differs from a present one's only in its
        data, which the plan must not read (``check_reads``). Returns False (nothing stood in) when
        a stage has no present file or its files differ (a save without redundant copies, say).
        """
        stand_ins: dict[int, SourceFile] = {}
        for r in missing:
            stage = r // self.n_src
            peers = [f for q, f in self.files.items() if q // self.n_src == stage and q not in self.stood_in]
            if not peers or any(f.tensors != peers[0].tensors for f in peers[1:]):
                return False
            model = peers[0]
            stand_ins[r] = SourceFile(self._rank_folder(r), r, model.tensors, model.metadata, model.strings)
        self.files.update(stand_ins)
        self.stood_in.update(stand_ins)
        return True

    def stage_representatives(self, wanted: Sequence[int], read: Iterable[str]) -> list[str]:
        """Files to keep beside those a plan reads, so that a node holding only these can run it.

        A needed source stage the plan reads nothing from still decides which names the output
        holds and where (``plan_rank``'s load order), so one of its files must be present: the
        lowest needed rank's. The other needed ranks are stood in for (``stand_in_missing``).
        """
        read_paths = set(read)
        present = {r: f for r, f in self.files.items() if r not in self.stood_in}
        if any(f.homes for f in present.values()):
            return []  # virtual rank files (a Checkpoint 2.0): metadata.json names every tensor of every stage
        extra: dict[str, None] = {}
        for rank in wanted:
            needed = self.needed(rank)
            stages_read = {r // self.n_src for r in needed if r in present and present[r].path in read_paths}
            for stage in sorted({r // self.n_src for r in needed} - stages_read):
                held = [r for r in sorted(needed) if r // self.n_src == stage and r in present]
                if held:
                    extra[present[held[0]].path] = None
        return [p for p in extra if p not in read_paths]

    def check_reads(
        self, plan_sources: Sequence[str], files: Iterable[tuple[int | None, Sequence[TensorPlan]]]
    ) -> None:
        """Refuse a plan that reads a stood-in rank, naming the first destination rank that does."""
        folders = {f.path: r for r, f in self.stood_in.items()}
        read = {i: folders[p] for i, p in enumerate(plan_sources) if p in folders}
        if not read:
            return
        for rank, tensors in files:
            wanted = sorted({read[c.source] for t in tensors for c in t.copies if c.source in read})
            if wanted:
                self._missing_error(rank if rank is not None else 0, wanted)
        self._missing_error(0, sorted(read.values()))

    def dst_map(self, rank: int) -> dict[str, StagedLayout] | None:
        if self.dst is None:
            return None
        key = rank // self.n_dst  # the rank-aware choice only depends on the stage
        if key not in self._dst_maps:
            self._dst_maps[key] = layout_map(self.dst, rank) if self._dst_base is None else self._dst_base
        return self._dst_maps[key]

    def stage_cut(self, rank: int) -> StageCut:
        """What destination ``rank``'s stage keeps of each parameter."""
        return stage_cut(self.src_map, self.dst_map(rank), rank // self.n_dst)

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
        cut = self.stage_cut(rank)
        keys: set[int] = set()
        for name, staged in (self.src_map or {}).items():
            if cut.role(name) is not Role.TRANSFORM:
                continue
            held = self._any_file_with(name, staged.stages)
            if held is None:
                continue
            with blame(name, self.src, f"the slice in {os.path.basename(held.path)}"):
                full = layout.full_shape(staged.layout, held.tensors[name].shape)
            dst_p = dst_map[name].layout if dst_map is not None else None
            with blame(name, self.dst, f"full shape {list(full)}"):
                pieces = layout.transfer_pieces(staged.layout, dst_p, full, rank % self.n_dst, any_device_num=True)
            keys |= {key for key, _ in pieces}
        stages = {s for name, staged in (self.src_map or {}).items() if name not in cut.dropped for s in staged.stages}
        return sorted({s * self.n_src + key for s in stages for key in keys}, reverse=True)

    def holders(self, load_order: Sequence[int], own_stage_only: bool) -> dict[str, dict[int, SourceFile]]:
        """name -> {source local rank: file}, as loading ``load_order`` leaves it (a later file
        replaces an earlier one's local rank; names keep their first position). Names loaded from
        the same files share one dict: callers must not change them.

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
        runs: set[int] = set()  # ids of run dicts given as they are to several names (copied before a change)
        for stage, names, group in self._runs(load_order):
            runs.add(id(group))
            for name in names:
                if own_stage.get(name, stage) != stage:
                    holders.setdefault(name, {})  # the position is the first appearance, as always
                    passed_over.setdefault(name, {}).update(group)
                    continue
                by_key = holders.get(name)
                if by_key is None:
                    holders[name] = group  # shared by every name of the run: the common case, no copy
                    continue
                if id(by_key) in runs:
                    by_key = holders[name] = dict(by_key)
                by_key.update(group)
        for name, by_key in passed_over.items():
            if not holders[name]:  # none of its own stage's files loaded: the usual checks decide
                holders[name] = by_key
        return holders

    def _runs(self, load_order: Sequence[int]) -> Iterator[tuple[int, tuple[str, ...], dict[int, SourceFile]]]:
        """``load_order`` in runs of consecutive files of one stage holding the same tensor names:
        (stage, names, {local rank: file} as loading the run leaves it). Loading a run name by name
        is then one ``dict.update`` per name instead of one assignment per file and name (a
        destination rank of a 4 096-rank job loads 64 files of hundreds of tensors)."""
        run: dict[int, SourceFile] = {}
        stage = -1
        names: tuple[str, ...] = ()
        for r in load_order:
            f = self.files[r]
            these = tuple(f.tensors)
            if run and (r // self.n_src != stage or these != names):
                yield stage, names, run
                run = {}
            stage, names = r // self.n_src, these
            run[r % self.n_src] = f
        if run:
            yield stage, names, run

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

    def layouts(
        self, name: str, dst_map: Mapping[str, StagedLayout] | None
    ) -> tuple[ParamLayout | None, ParamLayout | None]:
        """The source and destination layouts of a parameter to transform (None: a full tensor)."""
        src_p = self.src_map[name].layout if self.src_map is not None else None
        dst_p = dst_map[name].layout if dst_map is not None else None
        return src_p, dst_p

    def plan_rank(
        self, rank: int, sources: SourcePaths, load_order: Sequence[int] | None = None
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
                raise UsageError(
                    f"destination rank {rank} needs the checkpoint of source rank(s) "
                    f"{', '.join(map(str, sorted(missing)))}, which is missing"
                )
        holders = self.holders(load_order, rank in self.beyond)
        dst_map = self.dst_map(rank)
        cut = self.stage_cut(rank)
        local = rank % self.n_dst
        transformed: list[TensorPlan] = []
        to_transform, deferred = cut.sort(holders)
        device_n: int | None = None
        for name in to_transform:
            src_p, dst_p = self.layouts(name, dst_map)
            device_n = src_p.device_num if src_p is not None else 1
            transformed.append(self.transform_one(name, src_p, dst_p, holders[name], local, sources))
        if device_n is None:
            raise LayoutError("none of the checkpoint's parameters is in the source or destination strategy")
        for name in deferred:
            key = local % device_n
            if key not in holders[name] and rank in self.beyond:
                key = min(holders[name])  # no MindSpore rule to follow: the lowest rank's copy
            if key not in holders[name]:
                raise UsageError(f"parameter {name!r} is missing from the checkpoint of source rank {key}")
            transformed.append(whole_tensor(sources, holders[name][key], name))
        return tuple(transformed)

    def transform_one(
        self,
        name: str,
        src_p: ParamLayout | None,
        dst_p: ParamLayout | None,
        by_key: Mapping[int, SourceFile],
        local: int,
        sources: SourcePaths,
    ) -> TensorPlan:
        """Parameter ``name`` of destination local rank ``local``, assembled from the files ``by_key``
        (source local rank -> file); a layout of None is the full tensor."""
        first = next(iter(by_key.values())).tensors[name]
        with blame(name, self.src, f"the slice in {os.path.basename(next(iter(by_key.values())).path)}"):
            full = layout.full_shape(src_p, first.shape) if src_p is not None else first.shape
        with blame(name, self.dst, f"full shape {list(full)}"):
            dst_box = layout.rank_box(dst_p, full, local) if dst_p is not None else tuple((0, d) for d in full)
        with blame(name, self.src, f"full shape {list(full)}"):
            return self._pieces(name, src_p, dst_p, by_key, local, sources, full, dst_box, first.dtype)

    def _pieces(
        self,
        name: str,
        src_p: ParamLayout | None,
        dst_p: ParamLayout | None,
        by_key: Mapping[int, SourceFile],
        local: int,
        sources: SourcePaths,
        full: tuple[int, ...],
        dst_box: Box,
        dtype: DType,
    ) -> TensorPlan:
        triples = []
        for key, piece in layout.transfer_pieces(src_p, dst_p, full, local, any_device_num=True):
            held = layout.rank_box(src_p, full, key) if src_p is not None else tuple((0, d) for d in full)
            src = by_key.get(key) or redundant_copy(src_p, full, held, by_key)
            if src is None:
                raise UsageError(f"the checkpoint of source rank {key} is missing (needed for {name!r})")
            if src.tensors[name].shape != tuple(b - a for a, b in held):
                raise LayoutError(
                    f"{name!r} has shape {list(src.tensors[name].shape)}, but the strategy gives this rank "
                    f"a slice of {[b - a for a, b in held]}",
                    src.path,
                )
            triples.append((src, held, piece))
        return assembled(sources, name, name, triples, dst_box, dtype)


@contextlib.contextmanager
def blame(name: str, strategy: LayoutTable | None, what: str) -> Iterator[None]:
    """Re-raise a layout error naming the parameter, the strategy file and what it was applied to."""
    try:
        yield
    except LayoutError as exc:
        if exc.path and name in exc.detail:
            raise
        where = strategy.path if strategy is not None else exc.path
        raise LayoutError(f"parameter {name!r} ({what}): {exc.detail}", where) from None


def redundant_copy(
    src_p: ParamLayout | None, full: tuple[int, ...], held: Box, by_key: Mapping[int, SourceFile]
) -> SourceFile | None:
    """Another rank's identical copy of a slice, for checkpoints saved with ``remove_redundancy=True``
    (each slice is stored by only one rank of its redundancy group)."""
    if src_p is None:
        return None
    for key in sorted(by_key):
        if layout.rank_box(src_p, full, key) == held:
            return by_key[key]
    return None


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
    planner.check_agreement()
    order = list(files_map)
    interned = SourcePaths()
    fmt = rank_dirs.detect_format(out_path)
    tensors = planner.plan_rank(rank, interned, order)
    return Plan("transform", tuple(interned.paths), (FilePlan(out_path, fmt, tensors, output_metadata(fmt), rank),))


__all__ = ["StageCut", "TransformPlanner", "blame", "plan_transform_by_rank", "redundant_copy", "stage_cut"]
