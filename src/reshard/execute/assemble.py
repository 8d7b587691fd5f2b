"""Assembling a planned tensor from its copies: the one place that turns boxes into numpy copies.

A ``TensorPlan`` lists the boxes (``Copy``) of source tensors that make up one output tensor.
Three parts of reshard need those boxes put together in memory: the local executor (strided boxes,
row block by row block, into its staging buffer), ``verify`` (rows of a full tensor, to compare
them) and the MindSpore drop-in (whole tensors returned by ``load_distributed_checkpoint``). They
all call ``copy_boxes``, so what a checkpoint holds is decided by one function: what ``verify``
compares is what the executor writes.

``copy_boxes`` is on the executor's hot path: it does one ``np.copyto`` per box that meets the
block and nothing else (no allocation); the caller owns the destination buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reshard.plan import TensorPlan

SourceArray = Callable[[int, str], np.ndarray]  # (index into plan.sources, tensor name) -> its array


def _box(first: int, rows: int, starts: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of a box: ``rows`` rows from ``first`` on dim 0, then ``starts``/``lengths``."""
    return (slice(first, first + rows), *(slice(s, s + n) for s, n in zip(starts, lengths, strict=True)))


def copy_boxes(dst: np.ndarray, t: TensorPlan, first_row: int, source_array: SourceArray) -> None:
    """Copy every box of ``t`` that falls in ``dst`` into it.

    ``dst`` holds rows ``first_row`` to ``first_row + len(dst)`` (dim 0) of the full tensor ``t``;
    a 0-d tensor is its one copy. ``source_array(source, tensor)`` gives a source tensor's array.
    """
    if not t.shape:
        for c in t.copies:
            np.copyto(dst, source_array(c.source, c.tensor))
        return
    r0, r1 = first_row, first_row + dst.shape[0]
    for c in t.copies:
        lo, hi = max(r0, c.dst_start[0]), min(r1, c.dst_start[0] + c.lengths[0])
        if lo >= hi:
            continue
        src = source_array(c.source, c.tensor)
        if c.src_view is not None:
            src = src.reshape(c.src_view)  # a view of a C-order map: no copy
        dst_box = dst[_box(lo - r0, hi - lo, c.dst_start[1:], c.lengths[1:])]
        if c.src_perm is None:
            src_box = _box(c.src_start[0] + lo - c.dst_start[0], hi - lo, c.src_start[1:], c.lengths[1:])
            np.copyto(dst_box, src[src_box])
        else:  # destination rows lo:hi are a range of source axis src_perm[0]
            lengths = list(c.src_lengths)
            starts = list(c.src_start)
            starts[c.src_perm[0]] += lo - c.dst_start[0]
            lengths[c.src_perm[0]] = hi - lo
            box = tuple(slice(s, s + n) for s, n in zip(starts, lengths, strict=True))
            np.copyto(dst_box, src[box].transpose(c.src_perm))


def tensor_rows(t: TensorPlan, r0: int, r1: int, source_array: SourceArray) -> np.ndarray:
    """Rows ``r0:r1`` (dim 0) of the full tensor ``t`` (all of a 0-d one), read-only.

    Zero-copy where the plan allows it: a literal is a view of its bytes, one unchanged source
    tensor a view of the source; otherwise a new block filled by ``copy_boxes``.
    """
    if t.literal is not None:
        whole = np.frombuffer(t.literal, dtype=t.dtype.numpy).reshape(t.shape)
        return whole[r0:r1] if t.shape else whole
    if t.whole_copy:
        c = t.copies[0]
        whole = source_array(c.source, c.tensor)
        return whole[r0:r1] if t.shape else whole
    block = np.empty((r1 - r0, *t.shape[1:]) if t.shape else (), dtype=t.dtype.numpy)
    copy_boxes(block, t, r0, source_array)
    return block


def full_tensor(t: TensorPlan, source_array: SourceArray) -> np.ndarray:
    """The whole tensor ``t`` as a new array the caller owns (it outlives the sources' maps)."""
    if t.literal is not None:
        return np.frombuffer(t.literal, dtype=t.dtype.numpy).reshape(t.shape).copy()
    out = np.empty(t.shape, dtype=t.dtype.numpy)
    copy_boxes(out, t, 0, source_array)
    return out


__all__ = ["SourceArray", "copy_boxes", "full_tensor", "tensor_rows"]
