"""Boxes of a tensor seen through a reshaping view, as boxes of the tensor itself, and back.

A model map reads some tensors through a *view*, a C-order reshape that merges runs of adjacent
axes (unstacking Megatron-core's stacked layers reads ``[layers, rows, hidden]`` as
``[layers*rows, hidden]``) or inserts unit axes (stacking). A chunked source (a DCP folder) holds
boxes of the tensor in its own shape, so a copy of a box of the view is re-sourced through the box
of the tensor it is, and each chunk's piece is read through the same view of the chunk. Only boxes
that are one box on both sides are translated (``None`` otherwise): a range of a merged axis is one
box of the run it merges when it lies within one index of the outer axes and spans the inner ones.
Pure arithmetic over shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = tuple[int, ...]
Runs = tuple[tuple[int, ...], ...]  # per view axis: the tensor axes it merges (empty: an inserted unit axis)


def runs(view: Sequence[int], shape: Sequence[int]) -> Runs | None:
    """Which axes of ``shape`` each axis of ``view`` merges; None if ``view`` is not such a reshape.

    Example:
        from reshard.plan.views import runs
        assert runs((6, 4), (2, 3, 4)) == ((0, 1), (2,))
    """
    out: list[tuple[int, ...]] = []
    axis = 0
    for size in view:
        if size == 1 and (axis >= len(shape) or shape[axis] != 1):
            out.append(())
            continue
        run: list[int] = []
        product = 1
        while axis < len(shape) and (not run or product < size):
            product *= shape[axis]
            run.append(axis)
            axis += 1
        if product != size:
            return None
        out.append(tuple(run))
    return tuple(out) if axis == len(shape) else None


def to_tensor(
    runs_: Runs, shape: Sequence[int], start: Sequence[int], lengths: Sequence[int]
) -> tuple[Shape, Shape] | None:
    """Box ``start``+``lengths`` of the view as (start, lengths) of the tensor of ``shape``; None if not one box."""
    starts, sizes = [0] * len(shape), [0] * len(shape)
    for v, run in enumerate(runs_):
        if not run:
            continue
        dims = [shape[a] for a in run]
        one = _split_range(start[v], lengths[v], dims)
        if one is None:
            return None
        for a, (s, n) in zip(run, one, strict=True):
            starts[a], sizes[a] = s, n
    return tuple(starts), tuple(sizes)


def to_view(
    runs_: Runs, shape: Sequence[int], start: Sequence[int], lengths: Sequence[int]
) -> tuple[Shape, Shape] | None:
    """Box ``start``+``lengths`` of the tensor of ``shape`` as (start, lengths) of the view; None if not one box."""
    starts, sizes = [], []
    for run in runs_:
        if not run:
            starts.append(0)
            sizes.append(1)
            continue
        dims = [shape[a] for a in run]
        merged = _merge_range([start[a] for a in run], [lengths[a] for a in run], dims)
        if merged is None:
            return None
        starts.append(merged[0])
        sizes.append(merged[1])
    return tuple(starts), tuple(sizes)


def viewed_shape(runs_: Runs, shape: Sequence[int]) -> Shape:
    """``shape`` merged as ``runs_`` merge it."""
    return tuple(math.prod(shape[a] for a in run) for run in runs_)


def _split_range(a: int, n: int, dims: Sequence[int]) -> list[tuple[int, int]] | None:
    for j in range(len(dims)):
        stride = math.prod(dims[j + 1 :])
        if a % stride or n % stride:
            continue
        first, count = (a // stride) % dims[j], n // stride
        if first + count > dims[j]:
            continue
        outer = [((a // math.prod(dims[i + 1 :])) % dims[i], 1) for i in range(j)]
        return [*outer, (first, count), *((0, d) for d in dims[j + 1 :])]
    return None


def _merge_range(starts: Sequence[int], lengths: Sequence[int], dims: Sequence[int]) -> tuple[int, int] | None:
    j = next((i for i in range(len(dims)) if lengths[i] != 1), len(dims) - 1)
    if any(lengths[i] != dims[i] or starts[i] for i in range(j + 1, len(dims))):
        return None
    stride = math.prod(dims[j + 1 :])
    offset = sum(s * math.prod(dims[i + 1 :]) for i, s in enumerate(starts))
    return offset, lengths[j] * stride


__all__ = ["Runs", "runs", "to_tensor", "to_view", "viewed_shape"]
