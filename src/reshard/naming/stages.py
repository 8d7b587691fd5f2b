"""Maps in stages: a map applied to another map's outputs, its pieces still reading the inputs.

Megatron-core's distributed checkpoints stack a layer's tensors on a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[layers, rows, hidden]``) and its
experts on a second one; the per-layer tensor is in turn fused (Q, K, V grouped per query group).
One operation does not say both, and a table of every (stacked, fused) combination would be
unreadable. So a ``ModelMap`` may name a further map (``then``): stage one unstacks the layers,
stage two splits each layer's fused tensor. ``chained`` composes the two answers of
``reshard.naming.ops.apply``: every piece of stage two reads a box of a stage-one output, which is
itself pieces of the inputs, so each is rewritten as the pieces of the inputs it covers. The
composed pieces are still box copies (with a view and an axis permutation), so a plan streams
them like any other: nothing is materialised in between.

Composition is box arithmetic. A stage-two piece reading its intermediate tensor plainly (or
permuted) intersects each stage-one piece's output box; one reading it through a view (a stack's
inserted unit axis, an unstack's merged axes) first re-expresses the stage-one pieces in that
view (an axis inserted in their source's view too; merged axes merged in it, a box cut per outer
index when it does not span the inner axis). A merged view of a permuted piece is refused
(``UnsupportedError``); no preset makes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from reshard.errors import UnsupportedError
from reshard.naming import ops
from reshard.naming.ops import Applied, Derived, ModelMap, Piece, TensorInfo
from reshard.naming.report import NameReport

Shape = tuple[int, ...]


def apply(model_map: ModelMap, catalogue: Mapping[str, TensorInfo]) -> Applied:
    """Every stage of ``model_map`` applied to ``catalogue`` (``reshard.naming.ops.apply`` per stage, composed).

    Example:
        from reshard.naming import ModelMap, Rename, TensorInfo
        from reshard.naming.stages import apply
        m = ModelMap((Rename("a", "b"),), then=ModelMap((Rename("b", "c"),)))
        assert [d.name for d in apply(m, {"a": TensorInfo((2,), "Float32")}).outputs] == ["c"]
    """
    first = ops.apply(model_map, catalogue)
    return first if model_map.then is None else chained(first, model_map.then, catalogue)


def chained(first: Applied, rest: ModelMap, catalogue: Mapping[str, TensorInfo]) -> Applied:
    """``rest`` applied to ``first``'s outputs, its pieces rewritten to read ``catalogue``'s tensors.

    Args:
        first: The first stage's answer (outputs as pieces of ``catalogue``'s tensors).
        rest: The map of the next stages.
        catalogue: The input tensors of the first stage.

    Returns:
        The composed outputs and a report of every stage (a name is unmatched only when no stage
        matched it).

    Raises:
        UsageError: ``rest`` does not fit the intermediate tensors (see ``apply``).
        UnsupportedError: A view that is not a box of the input (see the module docstring).
    """
    middle = {d.name: d for d in first.outputs}
    second = apply(rest, {d.name: TensorInfo(d.shape, d.dtype) for d in first.outputs})
    shapes = {n: t.shape for n, t in catalogue.items()}
    outputs = tuple(_composed(d, middle, shapes) for d in second.outputs)
    untouched = set(first.report.unmatched)
    report = NameReport(
        renamed=first.report.renamed + second.report.renamed,
        surgery=first.report.surgery + second.report.surgery,
        unmatched=tuple(n for n in second.report.unmatched if n in untouched),
    )
    return Applied(outputs, report)


def _composed(d: Derived, middle: Mapping[str, Derived], shapes: Mapping[str, Shape]) -> Derived:
    pieces: list[Piece] = []
    for q in d.pieces:
        x = middle[q.source]
        inner = _in_view(x, q.view, shapes) if q.view is not None and q.view != x.shape else list(x.pieces)
        for p in inner:
            hit = through(p, q)
            if hit is not None:
                pieces.append(hit)
    return replace(d, pieces=tuple(pieces))


def _ident(n: int) -> Shape:
    return tuple(range(n))


def through(p: Piece, q: Piece) -> Piece | None:
    """Piece ``q`` (reading box ``q.src_start``+``q.src_lengths`` of X plainly) composed with piece ``p``
    (filling box ``p.dst_start``+``p.lengths`` of X from an input): the part of ``q`` that ``p`` fills,
    reading ``p``'s input; None if they do not meet.

    Example:
        from reshard.naming.ops import Piece
        from reshard.naming.stages import through
        p = Piece("a", (2, 0), (0, 0), (4, 3))  # X = rows 2..6 of a
        q = Piece("X", (1, 0), (0, 0), (2, 3))  # Y = rows 1..3 of X
        assert through(p, q) == Piece("a", (3, 0), (0, 0), (2, 3))
    """
    ndim = len(p.lengths)
    q_lengths = q.src_lengths
    lo = tuple(max(a, b) for a, b in zip(p.dst_start, q.src_start, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.dst_start, p.lengths, q.src_start, q_lengths, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    pp, pq = p.perm or _ident(ndim), q.perm or _ident(ndim)
    src = list(p.src_start)
    for i in range(ndim):  # X axis i is (viewed) input axis pp[i]
        src[pp[i]] += lo[i] - p.dst_start[i]
    dst = tuple(q.dst_start[j] + lo[pq[j]] - q.src_start[pq[j]] for j in range(ndim))
    lengths = tuple(hi[pq[j]] - lo[pq[j]] for j in range(ndim))
    perm = tuple(pp[pq[j]] for j in range(ndim))
    return Piece(p.source, tuple(src), dst, lengths, p.view, None if perm == _ident(ndim) else perm)


def _in_view(x: Derived, view: Shape, shapes: Mapping[str, Shape]) -> list[Piece]:
    """``x``'s pieces with their output boxes in ``view``'s coordinates (a unit axis inserted, or two merged)."""
    shape = x.shape
    if len(view) > len(shape):
        units = _units(view, shape)
        if units is not None:
            pieces = list(x.pieces)
            for k in units:  # in increasing order: each at its place in the final view
                pieces = [_unit(p, k, shapes) for p in pieces]
            return pieces
    if len(view) == len(shape) - 1:
        merges = [k for k in range(len(shape) - 1) if (*shape[:k], shape[k] * shape[k + 1], *shape[k + 2 :]) == view]
        if merges:
            return [m for p in x.pieces for m in _merged(p, merges[0], shape, shapes)]
    raise UnsupportedError(f"{x.name!r} is read as {list(view)}, which is not a view a model map makes")


def _units(view: Shape, shape: Shape) -> list[int] | None:
    """The axes of ``view`` that are unit axes inserted into ``shape`` (None: ``view`` is not that)."""
    units, j = [], 0
    for i, v in enumerate(view):
        if j < len(shape) and v == shape[j]:
            j += 1
        elif v == 1:
            units.append(i)
        else:
            return None
    return units if j == len(shape) else None


def _source_view(p: Piece, shapes: Mapping[str, Shape]) -> Shape:
    return p.view if p.view is not None else shapes[p.source]


def _insert(t: Sequence[int], k: int, v: int) -> Shape:
    return (*t[:k], v, *t[k:])


def _unit(p: Piece, k: int, shapes: Mapping[str, Shape]) -> Piece:
    """``p`` with a unit axis inserted at ``k`` of its output (and of its input's view)."""
    dst, lengths = _insert(p.dst_start, k, 0), _insert(p.lengths, k, 1)
    if p.perm is None:
        view = _insert(_source_view(p, shapes), k, 1)
        return Piece(p.source, _insert(p.src_start, k, 0), dst, lengths, view)
    view = (1, *_source_view(p, shapes))
    perm = (*(a + 1 for a in p.perm[:k]), 0, *(a + 1 for a in p.perm[k:]))
    return Piece(p.source, (0, *p.src_start), dst, lengths, view, perm)


def _merged(p: Piece, k: int, shape: Shape, shapes: Mapping[str, Shape]) -> list[Piece]:
    """``p`` with output axes ``k`` and ``k+1`` merged (its input's view merged alike); one piece per
    index of axis ``k`` when ``p`` does not span axis ``k+1``."""
    if p.perm is not None:
        raise UnsupportedError(f"{p.source!r}: a permuted piece cannot be read through merged axes")
    source = _source_view(p, shapes)
    inner, src_inner = shape[k + 1], source[k + 1]
    view = (*source[:k], source[k] * src_inner, *source[k + 2 :])
    full = p.lengths[k + 1] == inner == src_inner
    rows = [(0, p.lengths[k])] if full or p.lengths[k] == 1 else [(j, 1) for j in range(p.lengths[k])]

    def merge(t: Shape, at_k: int) -> Shape:
        return (*t[:k], at_k, *t[k + 2 :])

    return [
        Piece(
            p.source,
            merge(p.src_start, (p.src_start[k] + j) * src_inner + p.src_start[k + 1]),
            merge(p.dst_start, (p.dst_start[k] + j) * inner + p.dst_start[k + 1]),
            merge(p.lengths, n * p.lengths[k + 1]),
            view,
        )
        for j, n in rows
    ]


__all__ = ["apply", "chained", "through"]
