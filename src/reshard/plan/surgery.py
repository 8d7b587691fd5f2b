"""Name filters and model maps composed onto plans: still box copies, still streamed.

Two compositions, because a model map's sizes are about FULL tensors:

* **map after planning** (``compose_after``): a sharded source written as a full model
  (transform to one file, unify). The planner first builds each full tensor under its input name
  from the ranks' boxes; each output tensor of the map is then pieces of those full tensors, so
  every planned copy is seen through the piece's view (unit axis inserted by a stack, expert axis
  merged with the next one by an unstack; docs/naming.md §4) and intersected with the piece.
* **map before planning** (``mapped_source`` + ``resolve_mapped``): a full model as the source
  (a Hugging Face model, a unified folder, one full file). The map's outputs become one *virtual*
  full source file; any planner (to one full file, or sliced for a destination strategy) plans
  from it as from a real file; then every copy that reads the virtual file is replaced by the
  pieces of real source tensors it covers.

Renames alone fit everywhere (``compose_after`` per output file: names only). Filtering is
simpler still: ``narrowed`` drops tensors from an opened source before anything is planned, so
packing, parts and index files never see them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from reshard import dtypes
from reshard.errors import UnsupportedError
from reshard.naming.options import NameOptions
from reshard.naming.report import NameReport, check_family, check_strict
from reshard.plan.model import Copy, FilePlan, Plan, SourceFile, SourcePaths, SourceTensor, TensorPlan, TextOutput

Shape = tuple[int, ...]
SourceShape = Callable[[int, str], Shape]  # (plan source index, tensor) -> the stored tensor's shape

K = TypeVar("K", bound=Hashable)

if TYPE_CHECKING:  # the surgery vocabulary loads with the first map (a run without one needs none of it)
    from reshard.naming.ops import Derived, ModelMap, Piece, TensorInfo

MAPPED_SOURCE = "<model map>"  # the virtual source file's path (never a real path: angle brackets)


def narrowed(sf: SourceFile, keep: Container[str]) -> SourceFile:
    """``sf`` holding only the tensors named in ``keep`` (strings and file homes too)."""
    return replace(
        sf,
        tensors={n: t for n, t in sf.tensors.items() if n in keep},
        strings={n: v for n, v in sf.strings.items() if n in keep},
        homes={n: h for n, h in sf.homes.items() if n in keep} if sf.homes else sf.homes,
    )


def only_renames(model_map: ModelMap) -> bool:
    from reshard.naming.ops import Rename

    return all(isinstance(op, Rename) for op in model_map.all_ops())


# --------------------------------------------------------------------------------------------
# boxes


def intersect(c: Copy, start: Shape, lengths: Shape, at: Shape) -> Copy | None:
    """The part of copy ``c`` (which fills a region of tensor X) that lies in box ``start``+``lengths``
    of X, moved so that the box's corner lands at ``at`` of another tensor; None if it misses the box."""
    lo = tuple(max(a, b) for a, b in zip(c.dst_start, start, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(c.dst_start, c.lengths, start, lengths, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    new_lengths = tuple(h - low for low, h in zip(lo, hi, strict=True))
    perm = c.src_perm or tuple(range(len(lo)))
    src_start = list(c.src_start)
    for j, axis in enumerate(perm):
        src_start[axis] += lo[j] - c.dst_start[j]
    return Copy(
        c.source,
        c.tensor,
        tuple(src_start),
        tuple(t + low - b for t, low, b in zip(at, lo, start, strict=True)),
        new_lengths,
        whole_source=c.whole_source and new_lengths == c.lengths,
        src_view=c.src_view,
        src_perm=c.src_perm,
    )


def through_piece(c: Copy, p: Piece) -> Copy | None:
    """The part of copy ``c`` (filling a region of an input, no permutation) that piece ``p`` moves to its
    output; None if the piece reads none of it. ``c``'s region and ``p``'s source box are both in the
    input's (viewed) coordinates."""
    if c.src_perm is not None:
        raise UnsupportedError("a model map cannot compose onto a copy that already permutes axes")
    if p.perm is None:
        return intersect(c, p.src_start, p.lengths, p.dst_start)
    p_lengths = p.src_lengths
    lo = tuple(max(a, b) for a, b in zip(c.dst_start, p.src_start, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(c.dst_start, c.lengths, p.src_start, p_lengths, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return Copy(
        c.source,
        c.tensor,
        tuple(s + low - d for s, low, d in zip(c.src_start, lo, c.dst_start, strict=True)),
        tuple(p.dst_start[j] + lo[axis] - p.src_start[axis] for j, axis in enumerate(p.perm)),
        tuple(hi[axis] - lo[axis] for axis in p.perm),
        whole_source=c.whole_source
        and lo == c.dst_start
        and tuple(hi) == tuple(d + n for d, n in zip(c.dst_start, c.lengths, strict=True)),
        src_view=c.src_view,
        src_perm=p.perm,
    )


def _viewed(c: Copy, shape: Shape, view: Shape | None, source_shape: Shape) -> list[Copy]:
    """Copy ``c`` of a tensor of ``shape`` (reading a source of ``source_shape``) seen through ``view``.

    The views a model map makes: a unit axis inserted (stack), or an axis merged with the next
    (unstack). A copy that is not one box in the merged axis is cut into one copy per index of
    the outer axis.
    """
    if view is None or view == shape:
        return [c]
    if c.src_view is not None:
        raise UnsupportedError("a model map cannot view a tensor that is already read through a view")
    if len(view) == len(shape) + 1:
        k = next(k for k in range(len(view)) if view[:k] + view[k + 1 :] == shape and view[k] == 1)

        def unit(t: Shape, v: int) -> Shape:
            return (*t[:k], v, *t[k:])

        return [
            Copy(
                c.source,
                c.tensor,
                unit(c.src_start, 0),
                unit(c.dst_start, 0),
                unit(c.lengths, 1),
                c.whole_source,
                unit(source_shape, 1),
            )
        ]
    k = next(k for k in range(len(shape) - 1) if (*shape[:k], shape[k] * shape[k + 1], *shape[k + 2 :]) == view)
    inner, src_inner = shape[k + 1], source_shape[k + 1]
    src_view = (*source_shape[:k], source_shape[k] * src_inner, *source_shape[k + 2 :])
    full = c.lengths[k + 1] == inner == src_inner
    outer = [(0, c.lengths[k])] if full or c.lengths[k] == 1 else [(j, 1) for j in range(c.lengths[k])]
    out = []
    for j, n in outer:

        def merged(t: Shape, at_k: int) -> Shape:
            return (*t[:k], at_k, *t[k + 2 :])

        out.append(
            Copy(
                c.source,
                c.tensor,
                merged(c.src_start, (c.src_start[k] + j) * src_inner + c.src_start[k + 1]),
                merged(c.dst_start, (c.dst_start[k] + j) * inner + c.dst_start[k + 1]),
                merged(c.lengths, n * c.lengths[k + 1]),
                c.whole_source and len(outer) == 1,
                src_view,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# map after planning


def compose_after(plan: Plan, model_map: ModelMap, source_shape: SourceShape) -> tuple[Plan, NameReport]:
    """``plan`` (full tensors under input names, or any plan for a map of renames) with ``model_map`` applied.

    Each output tensor goes into the file of its first input, at that input's place. With names
    unique across the plan, one catalogue serves every file (a join may take inputs from several
    files); otherwise (per-rank outputs) each file is mapped on its own.

    Raises:
        UsageError: The map does not fit the tensors (see ``reshard.naming.apply``).
        UnsupportedError: Surgery on a string or on a tensor given literally.
    """
    all_names = [t.name for f in plan.files for t in f.tensors]
    per_file = len(set(all_names)) != len(all_names)
    reports: list[NameReport] = []
    files: list[FilePlan] = []
    if per_file:
        for f in plan.files:
            (mapped,), report = _map_files([f], model_map, source_shape)
            files.append(mapped)
            reports.append(report)
    else:
        mapped_files, report = _map_files(list(plan.files), model_map, source_shape)
        files, reports = list(mapped_files), [report]
    texts = _rewritten_texts(plan.texts, files)
    return Plan(plan.operation, plan.sources, tuple(files), texts), _merged(reports)


def _info(t: TensorPlan | SourceTensor) -> TensorInfo:
    """What the map sees of a tensor: its shape and dtype name."""
    from reshard.naming.ops import TensorInfo

    return TensorInfo(t.shape, t.dtype.ms_name)


def _map_files(
    files: Sequence[FilePlan], model_map: ModelMap, source_shape: SourceShape
) -> tuple[tuple[FilePlan, ...], NameReport]:
    by_name: dict[str, TensorPlan] = {}
    home: dict[str, int] = {}
    for k, f in enumerate(files):
        for t in f.tensors:
            by_name[t.name] = t
            home[t.name] = k
    from reshard.naming.stages import apply

    applied = apply(model_map, {n: _info(t) for n, t in by_name.items()})
    placed: list[list[TensorPlan]] = [[] for _ in files]
    for d in applied.outputs:
        placed[home[d.pieces[0].source]].append(_composed(d, by_name, source_shape))
    out = tuple(replace(f, tensors=tuple(ts)) for f, ts in zip(files, placed, strict=True))
    return out, replace(applied.report, mapped=True)


def _composed(d: Derived, by_name: Mapping[str, TensorPlan], source_shape: SourceShape) -> TensorPlan:
    first = by_name[d.pieces[0].source]
    if _unchanged(d, first):
        return replace(first, name=d.name)
    if first.literal is not None or first.dtype is dtypes.STR:
        raise UnsupportedError(f"{first.name!r} is a string: a model map can only rename it")
    copies: list[Copy] = []
    for p in d.pieces:
        t = by_name[p.source]
        for c in t.copies:
            shape = c.lengths if c.whole_source and c.src_view is None else source_shape(c.source, c.tensor)
            for v in _viewed(c, t.shape, p.view, shape):
                hit = through_piece(v, p)
                if hit is not None:
                    copies.append(hit)
    return TensorPlan(d.name, first.dtype, d.shape, tuple(copies), math.prod(d.shape) * first.dtype.itemsize)


def _unchanged(d: Derived, t: TensorPlan) -> bool:
    (p,) = d.pieces if len(d.pieces) == 1 else (None,)
    return p is not None and p.view is None and p.perm is None and d.shape == t.shape and p.lengths == t.shape


def _merged(reports: Sequence[NameReport]) -> NameReport:
    if len(reports) == 1:
        return reports[0]
    return NameReport(
        renamed=tuple(dict.fromkeys(r for rep in reports for r in rep.renamed)),
        surgery=tuple(dict.fromkeys(s for rep in reports for s in rep.surgery)),
        unmatched=tuple(dict.fromkeys(u for rep in reports for u in rep.unmatched)),
        mapped=True,
    )


def _rewritten_texts(texts: Sequence[TextOutput], files: Sequence[FilePlan]) -> tuple[TextOutput, ...]:
    """Index files (unify's ``param_name_map.json``, a Hugging Face index) naming the mapped tensors."""
    import json
    import os

    out = []
    for text in texts:
        if isinstance(text.text, bytes):  # a binary output (a DCP .metadata) indexes no tensor names
            out.append(text)
            continue
        try:
            doc = json.loads(text.text)
        except ValueError:
            out.append(text)
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
            out.append(text)
            continue
        indexed = set(doc["weight_map"].values())
        weight_map = {
            t.name: os.path.basename(f.path) for f in files if os.path.basename(f.path) in indexed for t in f.tensors
        }
        total = sum(t.nbytes for f in files if os.path.basename(f.path) in indexed for t in f.tensors)
        doc["weight_map"] = weight_map
        if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
            doc["metadata"]["total_size"] = total
        indent = 4 if text.text.startswith("{\n    ") else 2
        out.append(TextOutput(text.path, json.dumps(doc, indent=indent)))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# map before planning


class MappedModel:
    """A full model's tensors through a model map: a virtual source file and how to read it back.

    ``source`` is the virtual ``SourceFile`` (path ``MAPPED_SOURCE``) holding the map's outputs;
    ``name_to_file`` maps each output to it. ``resolve(plan)`` replaces every copy that reads it
    by copies of the real files.
    """

    def __init__(self, files: Mapping[str, SourceFile], name_to_file: Mapping[str, str], model_map: ModelMap) -> None:
        from reshard.naming.stages import apply

        self.real = {n: files[name_to_file[n]] for n in name_to_file}
        catalogue = {n: _info(sf.tensors[n]) for n, sf in self.real.items()}
        applied = apply(model_map, catalogue)
        self.report = replace(applied.report, mapped=True)
        self.outputs = {d.name: d for d in applied.outputs}
        tensors: dict[str, SourceTensor] = {}
        strings: dict[str, str] = {}
        for d in applied.outputs:
            first = self.real[d.pieces[0].source].tensors[d.pieces[0].source]
            if first.dtype is dtypes.STR and not _whole_rename(d, first.shape):
                raise UnsupportedError(f"{d.pieces[0].source!r} is a string: a model map can only rename it")
            nbytes = first.nbytes if first.dtype is dtypes.STR else math.prod(d.shape) * first.dtype.itemsize
            tensors[d.name] = SourceTensor(first.dtype, d.shape, nbytes)
            src_strings = self.real[d.pieces[0].source].strings
            if d.pieces[0].source in src_strings:
                strings[d.name] = src_strings[d.pieces[0].source]
        self.source = SourceFile(MAPPED_SOURCE, 0, tensors, {}, strings)
        self.name_to_file = {n: MAPPED_SOURCE for n in tensors}

    def resolve(self, plan: Plan) -> Plan:
        """``plan`` (planned from ``source``) reading the real files instead."""
        interned = SourcePaths()
        files = []
        for f in plan.files:
            tensors = tuple(self._resolved(t, plan.sources, interned) for t in f.tensors)
            files.append(replace(f, tensors=tensors))
        return Plan(plan.operation, tuple(interned.paths), tuple(files), plan.texts)

    def _resolved(self, t: TensorPlan, old: Sequence[str], interned: SourcePaths) -> TensorPlan:
        copies: list[Copy] = []
        for c in t.copies:
            if old[c.source] != MAPPED_SOURCE:
                copies.append(replace(c, source=interned.id(old[c.source])))
                continue
            for p in self.outputs[c.tensor].pieces:
                hit = intersect(self._piece_copy(p, interned), c.src_start, c.lengths, c.dst_start)
                if hit is not None:
                    copies.append(hit)
        return replace(t, copies=tuple(copies))

    def _piece_copy(self, p: Piece, interned: SourcePaths) -> Copy:
        sf = self.real[p.source]
        shape = sf.tensors[p.source].shape
        whole = p.src_lengths == (p.view or shape) and not any(p.src_start)
        source = interned.id(sf.path_of(p.source))
        return Copy(source, p.source, p.src_start, p.dst_start, p.lengths, whole, p.view, p.perm)


def _whole_rename(d: Derived, shape: Shape) -> bool:
    p = d.pieces[0]
    return len(d.pieces) == 1 and p.view is None and p.perm is None and d.shape == shape


# --------------------------------------------------------------------------------------------
# one run's names


class NameRun:
    """One operation's filters and map: narrows its sources, maps its plan, and keeps the report.

    An operation calls ``narrow`` (sharded sources) or ``narrow_full`` (a full model) once, right
    after its sources are opened, then either ``mapped_model`` before planning (full-model
    sources) or ``after`` on the plan (sharded sources). ``report`` is the name report.
    """

    def __init__(self, options: NameOptions | None) -> None:
        self.options = options or NameOptions()
        self.dropped: tuple[tuple[str, str], ...] = ()
        self.mapped: NameReport | None = None
        self.total = 0

    @property
    def active(self) -> bool:
        return self.options.active

    @property
    def model_map(self) -> ModelMap | None:
        return self.options.model_map

    @property
    def report(self) -> NameReport:
        return (self.mapped or NameReport()).with_dropped(self.dropped)

    def _keep(self, names: list[str]) -> set[str]:
        kept, dropped = self.options.filter.split(names)
        self.dropped = tuple(dropped)
        self.total = len(kept)
        return set(kept)

    def narrow(self, sources: Mapping[K, SourceFile]) -> dict[K, SourceFile]:
        """``sources`` without the tensors the filters drop.

        Raises:
            UsageError: An ``--include`` matches nothing, or nothing is left.
        """
        if not self.options.filter.active:
            self.total = len({n for sf in sources.values() for n in sf.tensors})
            return dict(sources)
        keep = self._keep(list(dict.fromkeys(n for sf in sources.values() for n in sf.tensors)))
        return {k: narrowed(sf, keep) for k, sf in sources.items()}

    def narrow_full(
        self, files: Mapping[str, SourceFile], name_to_file: Mapping[str, str], extra: SourceFile | None = None
    ) -> tuple[dict[str, SourceFile], dict[str, str], SourceFile | None]:
        """A full model's files, name map and ``extra`` file (unify's hyper parameters) without the dropped tensors."""
        names = list(dict.fromkeys([*name_to_file, *(extra.tensors if extra is not None else ())]))
        if not self.options.filter.active:
            self.total = len(names)
            return dict(files), dict(name_to_file), extra
        keep = self._keep(names)
        return (
            {k: narrowed(sf, keep) for k, sf in files.items()},
            {n: f for n, f in name_to_file.items() if n in keep},
            narrowed(extra, keep) if extra is not None else None,
        )

    def mapped_model(self, files: Mapping[str, SourceFile], name_to_file: Mapping[str, str]) -> MappedModel | None:
        """The map applied to a full model before planning (None without a map)."""
        if self.model_map is None:
            return None
        model = MappedModel(files, name_to_file, self.model_map)
        self._checked(model.report)
        return model

    def mapped_file(self, sources: Mapping[int, SourceFile]) -> MappedModel | None:
        """The map applied before planning to a source of one full file (None: no map, or not one file)."""
        if self.model_map is None or len(sources) != 1:
            return None
        (only,) = sources.values()
        return self.mapped_model({only.path: only}, {n: only.path for n in only.tensors})

    def after(self, plan: Plan, sources: Sequence[SourceFile], full: bool) -> Plan:
        """``plan`` with the map applied (unchanged without one).

        ``full``: the plan's tensors are whole tensors (surgery allowed); otherwise only renames.

        Raises:
            UnsupportedError: Surgery on a plan of sharded tensors.
        """
        if self.model_map is None or self.mapped is not None:
            return plan  # no map, or applied before planning
        if not full and not only_renames(self.model_map):
            raise UnsupportedError(
                f"{self.model_map.name} splits, joins or stacks tensors, which needs full tensors: write a full "
                "model (no destination strategy) first, or start from a full model"
            )
        shapes = {(sf.path_of(n), n): t.shape for sf in sources for n, t in sf.tensors.items()}

        def source_shape(source: int, tensor: str) -> Shape:
            return shapes[(plan.sources[source], tensor)]

        composed, report = compose_after(plan, self.model_map, source_shape)
        self._checked(report)
        return composed

    def check_config(
        self, tensors: Iterable[tuple[str, Shape]], also: tuple[Mapping[str, object], str] | None = None
    ) -> None:
        """Full tensors agree with the run's model config (``NameOptions.config``, else the map's) and
        with ``also`` (a Hugging Face source's own ``config.json`` and its path): ``naming.shapes``.

        Raises:
            UsageError: A tensor's shape or layer index disagrees with a config.
        """
        configs: list[tuple[Mapping[str, object], str | None]] = []
        if self.options.config is not None:
            configs.append((self.options.config, self.options.config_path))
        elif self.model_map is not None and self.model_map.config:
            configs.append((self.model_map.config, None))
        if also is not None:
            configs.append(also)
        if configs:
            from reshard.naming.shapes import check_config_shapes

            listed = list(tensors)
            for config, where in configs:
                check_config_shapes(listed, config, where)

    def _checked(self, report: NameReport) -> None:
        self.mapped = report
        what = self.model_map.name if self.model_map is not None else "the map"
        if self.options.guard_family:
            check_family(report, self.total, what)
        if self.options.strict:
            check_strict(report, what)


__all__ = [
    "MAPPED_SOURCE",
    "MappedModel",
    "NameRun",
    "compose_after",
    "intersect",
    "narrowed",
    "only_renames",
    "through_piece",
]
