"""Which source rank supplies each piece of a destination slice, and which ranks hold the same slice.

The copy-selection rule of docs/formats.md §3.5-§3.6 (``transfer_pieces``, ``transfer_table``: a
destination box as pieces of source boxes, each from the unique needed rank holding it) and
MindSpore's ``get_parameter_redundancy`` (``redundancy_groups``). Apart from ``algebra`` (boxes,
flat layouts, needed ranks), which they build on and which never needs them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from reshard.errors import LayoutError, UnsupportedError
from reshard.layout.algebra import (
    _PAIR_CACHE,
    _RANK_CACHE,
    AUTO_OPT_SIZE,
    NOT_SPLIT,
    Axis,
    FlatLayout,
    Piece,
    _check_rank,
    _flat_and_groups,
    _fmt,
    _Geometry,
    _geometry,
    _ints,
    _needed_structure,
    _NeededSet,
    _suffix,
    _values,
    box_volume,
    normalize_device_num,
    slice_shape,
    unsharded_flat,
)
from reshard.layout.types import ParamLayout

# --------------------------------------------------------------------------------------------
# transfer pieces (docs/formats.md §3.5 copy-selection rule, §3.6)


@dataclass(frozen=True)
class _Transfer:
    """Everything about one (src layout, dst layout, full shape) that does not depend on the rank.

    Source slices form a grid ("cells" of ``lengths``). The lowest rank holding a cell is a sum of
    one term per dim (each dim is split by its own device axes and the lowest holder has 0 on
    every repeat axis), so per-dim tables give any cell's holder, and a destination box's pieces
    are the product of per-dim interval lists: O(number of pieces) per rank.
    """

    n_src: int
    n_dst: int
    dst_geo: _Geometry
    lengths: tuple[int, ...]  # source slice length per dim
    holders: tuple[tuple[int, ...], ...]  # per dim, per slice index: term of the lowest holder
    gathered: tuple[tuple[int, ...], ...] | None  # the same terms restricted to gathered axes
    keep: tuple[Axis, ...]  # MindSpore's keep axes (empty when the counts do not divide)


def _side(p: ParamLayout | None, shape: tuple[int, ...]) -> tuple[FlatLayout, _Geometry]:
    if p is None:
        flat = unsharded_flat(shape)
        return flat, _geometry(flat, (1,) * len(shape))
    flat, groups = _flat_and_groups(p, shape)
    return flat, _geometry(flat, groups)


def _replaced(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    """``values`` with ``values[index]`` replaced by ``value``."""
    return (*values[:index], value, *values[index + 1 :])


def _holder_tables(geo: _Geometry, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(slice lengths, per-dim holder terms); checks the per-dim decomposition on every rank."""
    lengths = tuple(hi - lo for lo, hi in geo.box(0))
    if not all(lengths):
        return lengths, tuple(() for _ in shape)
    lowest: dict[tuple[int, ...], int] = {}
    for r in range(geo.device_num):
        lowest.setdefault(tuple(lo // ln for (lo, _), ln in zip(geo.box(r), lengths, strict=True)), r)
    zero = (0,) * len(shape)
    holders = tuple(
        tuple(lowest[_replaced(zero, t, i)] for i in range(size // ln))
        for t, (size, ln) in enumerate(zip(shape, lengths, strict=True))
    )
    for cell, r in lowest.items():
        if sum(h[i] for h, i in zip(holders, cell, strict=True)) != r:
            raise UnsupportedError(f"source slices of shape {list(lengths)} are not a per-dim product")
    return lengths, holders


@functools.lru_cache(maxsize=_PAIR_CACHE)
def _transfer(src_p: ParamLayout | None, dst_p: ParamLayout | None, shape: tuple[int, ...]) -> _Transfer:
    if src_p is not None:
        slice_shape(src_p, shape)
    if dst_p is not None:
        slice_shape(dst_p, shape)
    src_flat, src_geo = _side(src_p, shape)
    dst_flat, dst_geo = _side(dst_p, shape)
    lengths, holders = _holder_tables(src_geo, shape)
    try:
        pair = normalize_device_num(src_flat, dst_flat)
    except LayoutError:
        return _Transfer(src_geo.device_num, dst_geo.device_num, dst_geo, lengths, holders, None, ())
    ns = _needed_structure(*pair) if all(lengths) else _NeededSet((), (), (0,), False)
    gathered = tuple(
        tuple(sum(((h // stride) % size) * stride for stride, size in ns.gather) for h in per_dim)
        for per_dim in holders
    )
    return _Transfer(src_geo.device_num, dst_geo.device_num, dst_geo, lengths, holders, gathered, ns.keep)


@functools.lru_cache(maxsize=_RANK_CACHE)
def _pieces(
    src_p: ParamLayout | None, dst_p: ParamLayout | None, shape: tuple[int, ...], dst_rank: int, any_num: bool
) -> tuple[Piece, ...]:
    """Pieces of ``dst_rank``, row-major over the source slices.

    MindSpore's copy (counts divide): the needed rank holding a slice has the slice's coordinates
    on the gathered axes (source-split axes, carried by any holder, e.g. the lowest) and the
    destination rank's coordinates on the keep axes (docs/formats.md §3.5). Otherwise (``any_num``): the
    lowest holder. Exact tiling of the destination box by these pieces is what the tests check
    against a naive reference and MindSpore itself.
    """
    tr = _transfer(src_p, dst_p, shape)
    dst_rank = _check_rank(dst_rank, tr.n_dst, "destination layout")
    dst_box = tr.dst_geo.box(dst_rank)
    if box_volume(dst_box) == 0:
        return ()
    if tr.gathered is not None:
        terms, base = tr.gathered, sum(((dst_rank // stride) % size) * stride for stride, size in tr.keep)
    elif any_num:
        terms, base = tr.holders, 0
    else:
        raise LayoutError(f"Cannot transform device_num from {tr.n_src} to {tr.n_dst}: neither divides the other")
    per_dim = [
        [(vals[i], (max(lo, i * ln), min(hi, i * ln + ln))) for i in range(lo // ln, -(-hi // ln))]
        for (lo, hi), ln, vals in zip(dst_box, tr.lengths, terms, strict=True)
    ]
    n_src = tr.n_src
    if len(per_dim) == 1:  # the common ranks, unrolled: this loop is the planner's inner loop
        return tuple(((base + v) % n_src, (iv,)) for v, iv in per_dim[0])
    if len(per_dim) == 2:
        return tuple(((base + v0 + v1) % n_src, (i0, i1)) for v0, i0 in per_dim[0] for v1, i1 in per_dim[1])
    return tuple(
        ((base + sum(v for v, _ in combo)) % n_src, tuple(iv for _, iv in combo))
        for combo in itertools.product(*per_dim)
    )


def transfer_pieces(
    src_p: ParamLayout | None,
    dst_p: ParamLayout | None,
    full_shape: Sequence[int],
    dst_rank: int,
    *,
    any_device_num: bool = False,
) -> list[Piece]:
    """``(source rank in [0, N_src), box of the full tensor)`` pieces that tile ``dst_rank``'s box.

    ``src_p=None``: the source is the full tensor (rank 0); ``dst_p=None``: the destination is
    the full tensor (rank 0). Every element comes from the copy MindSpore uses: the needed rank
    (docs/formats.md §3.5) whose coordinates on the keep axes equal the destination rank's, mapped to a file by
    ``% N_src``. Pieces are listed in ascending needed-rank order.

    ``any_device_num=True`` goes beyond MindSpore when neither device count divides the other
    (e.g. 4 -> 6): the destination box is then tiled from the lowest source rank holding each
    source slice (= the copy with coordinate 0 on every repeat axis). When the counts divide, the
    flag changes nothing.
    """
    return list(_pieces(src_p, dst_p, _ints(full_shape, "shape"), dst_rank, any_device_num))


def transfer_table(
    src_p: ParamLayout | None,
    dst_p: ParamLayout | None,
    full_shape: Sequence[int],
    *,
    any_device_num: bool = False,
) -> tuple[tuple[Piece, ...], ...]:
    """``transfer_pieces`` for every destination rank at once, indexed by rank (cached).

    Meant for bulk planning: parameters sharing (layouts, shape) share one answer, so planning
    many parameters costs one dictionary lookup each after the first.
    """
    return _table(src_p, dst_p, _ints(full_shape, "shape"), any_device_num)


@functools.lru_cache(maxsize=_PAIR_CACHE)
def _table(
    src_p: ParamLayout | None, dst_p: ParamLayout | None, shape: tuple[int, ...], any_num: bool
) -> tuple[tuple[Piece, ...], ...]:
    n_dst = _transfer(src_p, dst_p, shape).n_dst
    # The uncached body: a table holds every rank, so per-rank memo entries would only evict others.
    return tuple(_pieces.__wrapped__(src_p, dst_p, shape, r, any_num) for r in range(n_dst))


# --------------------------------------------------------------------------------------------
# redundancy (get_parameter_redundancy, docs/formats.md §3.3 end)


@functools.lru_cache(maxsize=_PAIR_CACHE)
def redundancy_groups(p: ParamLayout, initial_rank: int = 0) -> tuple[tuple[int, ...], ...]:
    """``get_parameter_redundancy`` for one layout item: groups of ranks holding identical data.

    MindSpore quirks kept: only ``tensor_map[0]`` (for Layout-API maps: the first dim's list)
    and the device matrix are read; groups are ordered by the coordinates on the used dev dims,
    innermost value first; with an optimizer shard every group is split into ``size`` strided
    subgroups and groups whose length ``size`` does not divide are silently dropped.
    """
    dev, n = p.dev_matrix, len(p.dev_matrix)
    if any(d < 1 for d in dev):
        raise LayoutError(f"{_fmt(p)}: device matrix dims must be positive integers")
    first = _values(p.tensor_map[0]) if p.is_list_map else cast("tuple[int, ...]", tuple(p.tensor_map))
    values = sorted({v for v in first if v != NOT_SPLIT})
    if any(not 0 <= v < n for v in values):
        raise LayoutError(f"{_fmt(p)}: tensor-map value outside the device matrix")
    strides = [(_suffix(dev, n - 1 - v), dev[n - 1 - v]) for v in values]
    by_key: dict[tuple[int, ...], list[int]] = {}
    for r in range(math.prod(dev)):
        by_key.setdefault(tuple((r // st) % sz for st, sz in strides), []).append(r + initial_rank)
    groups = [tuple(by_key[k]) for k in sorted(by_key)]
    size = p.opt_shard_size
    if size == 0:
        return tuple(groups)
    if size == AUTO_OPT_SIZE:
        if p.opt_shard_step <= 0:
            raise LayoutError(f"{_fmt(p)}: opt_shard_size -1 needs a positive opt_shard_step")
        size = len(groups) * len(groups[0]) // p.opt_shard_step
    if size <= 0:
        raise LayoutError(f"{_fmt(p)}: optimizer shard size resolves to {size}")
    return tuple(g[i::size] for g in groups if len(g) % size == 0 for i in range(size))


__all__ = ["redundancy_groups", "transfer_pieces", "transfer_table"]
