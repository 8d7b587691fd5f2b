"""Check a plan before a byte is written (as torch DCP's ``_validate_global_plan`` does).

A planner bug must never become silent zeros in a preallocated output: every output is
preallocated, so a destination region no copy fills stays zero and a region two copies fill holds
whichever came last, and nothing downstream would notice. So every executor path runs
``validate_plan`` first. It checks, without reading any file:

* output paths are unique, and tensor names are unique within each output;
* each copy lies inside its destination tensor (and, where the source's shape is known, inside
  its source tensor), with as many dimensions as both;
* the copies of each destination tensor cover it exactly once: no two overlap and their volumes
  add up to the tensor's (so no gap is left either); a tensor given literally has no copies and
  exactly its byte count.

Bulk transform plans (``RankTensors``) share one table of relative copies per class (source
layout, destination layout, full shape) and destination rank; those tables are checked once each,
against the class's destination box and the source slice each copy reads, so a 1 000-parameter x
1 024-rank plan is checked without building a million ``TensorPlan`` objects. (Planning already
checked the source files' slice shapes against those slices, once per class and source rank.)
Plans from chunk boxes (``BoxTensors``) are checked the same way, once per (chunking class, output);
planning saw no file there, so when the executor passes its opened sources, every chunk an output
reads is also checked against the shape of the tensor holding it (once per file and tensor).

A violation raises ``PlanError``: an internal error naming the output and the tensor, never a
``ReshardError``, because no input can cause it; only a bug in reshard can.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard

from reshard.plan.model import Plan, TensorPlan

if TYPE_CHECKING:
    from reshard.plan.boxes import BoxTensors
    from reshard.plan.bulk import RankTensors

SourceShape = Callable[[int, str], "tuple[int, ...] | None"]  # (source index, tensor) -> its shape, None: absent


class PlanError(RuntimeError):
    """A plan that would write wrong bytes: a bug in reshard, not a problem with the user's files."""


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, lengths)


def validate_plan(plan: Plan, source_shape: SourceShape | None = None) -> None:
    """Raise ``PlanError`` unless every output of ``plan`` is filled exactly once, inside all bounds.

    ``source_shape`` (optional) gives the shape of a source tensor, to check each copy's source box
    too (the executor passes its opened sources; planning had only their headers).
    """
    _unique_paths(plan)
    checked_tables: set[int] = set()
    held_shapes: dict[int, list[tuple[int, ...]]] = {}  # per class: the shape of each source rank's slice
    source_ids: dict[str, int] | None = None  # box plans: source path -> index, built once
    for f in plan.files:
        if _bulk(f.tensors):
            _check_bulk(f.path, f.tensors, checked_tables, held_shapes)
            continue
        if _boxes(f.tensors):
            if source_ids is None:
                source_ids = {p: i for i, p in enumerate(plan.sources)}
            _check_box_file(f.path, f.tensors, checked_tables, source_ids, source_shape)
            continue
        names: set[str] = set()
        for t in f.tensors:
            if t.name in names:
                raise PlanError(f"{f.path}: tensor {t.name!r} is planned twice")
            names.add(t.name)
            _check_tensor(f.path, t, len(plan.sources), source_shape)


# A file's tensors are a planner's lazy list only if that planner's module was imported: checked
# without importing it, so validating a convert's plan loads no transform or DCP planner.
def _bulk(tensors: object) -> TypeGuard[RankTensors]:
    module = sys.modules.get("reshard.plan.bulk")
    return module is not None and isinstance(tensors, module.RankTensors)


def _boxes(tensors: object) -> TypeGuard[BoxTensors]:
    module = sys.modules.get("reshard.plan.boxes")
    return module is not None and isinstance(tensors, module.BoxTensors)


def _unique_paths(plan: Plan) -> None:
    seen: set[str] = set()
    for path in [f.path for f in plan.files] + [t.path for t in plan.texts]:
        if path in seen:
            raise PlanError(f"{path}: planned as two outputs")
        seen.add(path)


def _check_tensor(path: str, t: TensorPlan, n_sources: int, source_shape: SourceShape | None) -> None:
    where = f"{path}: tensor {t.name!r}"
    if t.literal is not None:
        if t.copies or len(t.literal) != t.nbytes:
            raise PlanError(f"{where}: given literally ({len(t.literal)} bytes for {t.nbytes}) but also copied")
        return
    boxes: list[Box] = []
    for k, c in enumerate(t.copies):
        if not 0 <= c.source < n_sources:
            raise PlanError(f"{where}: copy {k} reads source {c.source} of {n_sources}")
        src = source_shape(c.source, c.tensor) if source_shape is not None else None
        if source_shape is not None and src is None:
            raise PlanError(f"{where}: copy {k} reads {c.tensor!r}, which its source file does not hold")
        if c.src_view is not None:
            if src is not None and math.prod(c.src_view) != math.prod(src):
                raise PlanError(f"{where}: copy {k} views its source {list(src)} as {list(c.src_view)}")
            src = c.src_view
        if c.src_perm is not None:
            if sorted(c.src_perm) != list(range(len(c.lengths))):
                raise PlanError(f"{where}: copy {k} permutes axes by {list(c.src_perm)}, not a permutation")
            if src is not None and (len(src) != len(c.lengths) or not _inside(c.src_start, c.src_lengths, src)):
                box = _box_text(c.src_start, c.src_lengths)
                raise PlanError(f"{where}: copy {k} reads {box}, outside its source tensor's shape {list(src)}")
            src = None  # checked above, in the source's axis order
        _check_bounds(where, k, c.src_start, c.dst_start, c.lengths, t.shape, src)
        boxes.append((c.dst_start, c.lengths))
    _check_cover(where, t.shape, boxes)


def _check_bounds(
    where: str,
    k: int,
    src_start: Sequence[int],
    dst_start: Sequence[int],
    lengths: Sequence[int],
    shape: Sequence[int],
    src_shape: Sequence[int] | None,
) -> None:
    if not len(src_start) == len(dst_start) == len(lengths) == len(shape):
        raise PlanError(f"{where}: copy {k} has {len(lengths)} dimensions, the tensor {len(shape)}")
    if any(n < 0 for n in lengths):
        raise PlanError(f"{where}: copy {k} has negative lengths {list(lengths)}")
    if not _inside(dst_start, lengths, shape):
        raise PlanError(
            f"{where}: copy {k} writes {_box_text(dst_start, lengths)}, outside the tensor's shape {list(shape)}"
        )
    if src_shape is not None and (len(src_shape) != len(lengths) or not _inside(src_start, lengths, src_shape)):
        raise PlanError(
            f"{where}: copy {k} reads {_box_text(src_start, lengths)}, outside its source tensor's "
            f"shape {list(src_shape)}"
        )
    if any(s < 0 for s in src_start):
        raise PlanError(f"{where}: copy {k} reads from a negative start {list(src_start)}")


def _inside(start: Sequence[int], lengths: Sequence[int], shape: Sequence[int]) -> bool:
    return all(s >= 0 and s + n <= d for s, n, d in zip(start, lengths, shape, strict=True))


def _box_text(start: Sequence[int], lengths: Sequence[int]) -> str:
    return "[" + ", ".join(f"{s}:{s + n}" for s, n in zip(start, lengths, strict=True)) + "]"


def _check_cover(where: str, shape: Sequence[int], boxes: Iterable[Box]) -> None:
    """The boxes cover ``shape`` exactly once: no overlap, and their volumes add up to the tensor's."""
    nonempty = [b for b in boxes if all(b[1])] if shape else list(boxes)
    volume = sum(math.prod(n) for _, n in nonempty)
    expected = math.prod(shape)
    if shape:
        overlap = _first_overlap(nonempty)
        if overlap is not None:
            a, b = overlap
            raise PlanError(f"{where}: copies overlap at {_box_text(*a)} and {_box_text(*b)}")
    if volume != expected:
        gap = "leave a gap" if volume < expected else "cover some elements twice"
        raise PlanError(f"{where}: the copies fill {volume} of its {expected} elements (they {gap})")


def _first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two boxes that share an element, by a sweep along dimension 0 (boxes are few per tensor)."""
    ordered = sorted(boxes, key=lambda b: b[0][0])
    for i, (a_start, a_len) in enumerate(ordered):
        a_end0 = a_start[0] + a_len[0]
        for b_start, b_len in ordered[i + 1 :]:
            if b_start[0] >= a_end0:
                break
            if all(
                bs < as_ + an and as_ < bs + bn for as_, an, bs, bn in zip(a_start, a_len, b_start, b_len, strict=True)
            ):
                return (a_start, a_len), (b_start, b_len)
    return None


def _check_bulk(
    path: str, tensors: RankTensors, checked: set[int], held_shapes: dict[int, list[tuple[int, ...]]]
) -> None:
    """One lazy transform output: each (class, rank) table once; names once per template."""
    template = tensors.template
    if id(template) not in checked:
        names = [t.name for t in template.transformed] + [name for name, _ in template.deferred]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise PlanError(f"{path}: tensor {twice!r} is planned twice")
        checked.add(id(template))
    for index, (cls, share) in enumerate(zip(template.classes, tensors.shares, strict=True)):
        if id(share) in checked:
            continue
        held = held_shapes.get(id(cls))
        if held is None:
            held = held_shapes[id(cls)] = [tuple(b - a for a, b in box) for box in cls.src_boxes]
        if not _table_ok(share.shape, share.copies, held):  # the fast check; the slow one says what is wrong
            where = f"{path}: tensor {template.members[index][0].name!r} (and every tensor of its layout class)"
            _explain_table(where, share.shape, share.copies, held)
        checked.add(id(share))


def _table_ok(shape: tuple[int, ...], copies: Sequence[tuple], held: Sequence[tuple[int, ...]]) -> bool:
    """``_explain_table``'s checks without building messages (1 024 ranks x every class of a plan)."""
    ndim, volume = len(shape), 0
    for key, src_start, dst_start, lengths, _ in copies:
        if not 0 <= key < len(held) or not len(src_start) == len(dst_start) == len(lengths) == ndim:
            return False
        for s, d, n, h, size in zip(src_start, dst_start, lengths, held[key], shape):  # noqa: B905 - checked above
            if n < 0 or s < 0 or d < 0 or s + n > h or d + n > size:
                return False
        volume += math.prod(lengths)
    if volume != math.prod(shape):
        return False
    return len(copies) < 2 or not ndim or _first_overlap([(c[2], c[3]) for c in copies if all(c[3])]) is None


def _explain_table(
    where: str, shape: tuple[int, ...], copies: Sequence[tuple], held: Sequence[tuple[int, ...]]
) -> None:
    boxes: list[Box] = []
    for k, (key, src_start, dst_start, lengths, _) in enumerate(copies):
        if not 0 <= key < len(held):
            raise PlanError(f"{where}: copy {k} reads source rank {key} of {len(held)}")
        _check_bounds(where, k, src_start, dst_start, lengths, shape, held[key])
        boxes.append((dst_start, lengths))
    _check_cover(where, shape, boxes)


def _check_box_file(
    path: str, tensors: BoxTensors, checked: set[int], ids: Mapping[str, int], source_shape: SourceShape | None
) -> None:
    """One lazy box-plan output: names once per layout, each (class, output) table once, and, when
    the sources are open, every chunk the output reads against its real shape."""
    layout = tensors.layout
    if id(layout) not in checked:
        names = [m.name for m in layout.members]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise PlanError(f"{path}: tensor {twice!r} is planned twice")
        checked.add(id(layout))
    for cls, share in tensors.shares:
        if id(share) in checked:
            continue
        if not _table_ok(share.shape, share.copies, cls.held):
            member = next(m for m in layout.members if m.cls is cls)
            _explain_table(
                f"{path}: tensor {member.name!r} (and every tensor of its chunking)",
                share.shape,
                share.copies,
                cls.held,
            )
        checked.add(id(share))
    if source_shape is not None:
        _check_box_sources(path, tensors, ids, source_shape)


def _check_box_sources(path: str, tensors: BoxTensors, ids: Mapping[str, int], source_shape: SourceShape) -> None:
    """Each chunk an output reads has, in its file, the shape of its box (what planning could not see)."""
    seen: set[tuple[int | None, str]] = set()
    for m in tensors.layout.members:
        share, source = m.cls.share(tensors.f), m.source
        for k, *_ in share.copies:
            index = ids.get(source.files[k])
            key = (index, source.tensor_of(k))
            if key in seen:
                continue
            seen.add(key)
            shape = source_shape(index, key[1]) if index is not None else None
            if shape is None or tuple(shape) != m.cls.held[k]:
                raise PlanError(
                    f"{path}: tensor {m.name!r} reads {source.tensor_of(k)!r} of {source.files[k]} as a chunk of "
                    f"shape {list(m.cls.held[k])}, but it has shape {shape}"
                )


__all__ = ["PlanError", "validate_plan"]
