"""Which source ranks a destination rank needs across pipeline stages (docs/formats.md §3.7).

MindSpore's ``rank_list_for_transform`` answers it for a whole strategy: the union, over every
parameter of the destination rank's stage, of the source ranks holding a piece of that rank's
slice. Apart from ``algebra`` (the per-parameter slice algebra it builds on) because it reads a
strategy's stage maps, not one layout; the per-stage views are memoised, since a job asks it for
each of its ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from reshard.errors import LayoutError
from reshard.layout.algebra import (
    _PAIR_CACHE,
    flat_layout,
    full_shape,
    needed_ranks,
    unsharded_flat,
)
from reshard.layout.types import ParamLayout, StagedLayout


def _device_num(first: ParamLayout | int | None, mapping: Mapping[str, StagedLayout], what: str) -> int:
    if isinstance(first, int):
        return first
    if first is None:
        if not mapping:
            raise LayoutError(f"The {what} strategy has no layout items")
        first = next(iter(mapping.values())).layout
    if not first.dev_matrix:
        raise LayoutError(f"The {what} strategy's first layout item has an empty device matrix")
    return first.device_num


@functools.lru_cache(maxsize=_PAIR_CACHE)
def _param_need(src_p: ParamLayout, dst_p: ParamLayout | None, local: int) -> frozenset[int]:
    """Local source ranks one parameter needs, on MindSpore's fake shape (docs/formats.md §3.5 step 1)."""
    n_src = src_p.device_num
    n_dst = dst_p.device_num if dst_p is not None else 1
    ndim = len(src_p.tensor_map)
    shape = full_shape(src_p, [max(n_src, n_dst)] * ndim)
    src_flat = flat_layout(src_p, shape)
    dst_flat = flat_layout(dst_p, shape) if dst_p is not None else unsharded_flat(shape)
    return frozenset(s % n_src for s in needed_ranks(src_flat, dst_flat, local))


@dataclass(frozen=True)
class _StageView:
    """What rank_list_for_transform needs from the maps for one destination stage."""

    pairs: tuple[tuple[str, ParamLayout, ParamLayout | None], ...]  # distinct layout pairs (first name)
    stages: tuple[int, ...]  # source stages of every remaining source parameter


# Identity memo of stage views: a planner asks for every destination rank with the same two map
# objects, and scanning 1 000 parameters per rank would dominate planning. Entries keep the maps
# alive and are checked by identity and size; maps are treated as immutable once passed in.
_VIEWS: dict[tuple[int, int, int | None], tuple[object, object, int, int, _StageView]] = {}
_VIEW_MEMO = 32


def _stage_view(
    src: Mapping[str, StagedLayout], dst: Mapping[str, StagedLayout] | None, stage: int | None
) -> _StageView:
    key = (id(src), id(dst), stage)
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst and hit[2] == len(src) and hit[3] == len(dst or ()):
        return hit[4]
    view = _build_view(src, dst, stage)
    if len(_VIEWS) >= _VIEW_MEMO:
        _VIEWS.clear()
    _VIEWS[key] = (src, dst, len(src), len(dst or ()), view)
    return view


def _build_view(
    src: Mapping[str, StagedLayout], dst: Mapping[str, StagedLayout] | None, stage: int | None
) -> _StageView:
    src_items = dict(src)
    dst_items = dict(dst) if dst else None
    if dst_items:
        cut = {name for name, item in dst_items.items() if stage not in item.stages}
        dst_items = {k: v for k, v in dst_items.items() if k not in cut}
        src_items = {k: v for k, v in src_items.items() if k not in cut}
    if not src_items:
        raise LayoutError("The src_strategy_file is empty.")
    pairs: dict[tuple[ParamLayout, ParamLayout | None], str] = {}
    for name, item in src_items.items():
        if dst_items and name not in dst_items:
            continue  # absent from the destination: needs nothing, but its stages still count
        pairs.setdefault((item.layout, dst_items[name].layout if dst_items else None), name)
    stages = tuple(sorted({s for item in src_items.values() for s in item.stages}))
    return _StageView(tuple((name, sp, dp) for (sp, dp), name in pairs.items()), stages)


def rank_list_for_transform(
    rank_id: int,
    src: Mapping[str, StagedLayout] | None,
    dst: Mapping[str, StagedLayout] | None,
    src_first: ParamLayout | int | None = None,
    dst_first: ParamLayout | int | None = None,
) -> list[int]:
    """``ms.rank_list_for_transform`` (docs/formats.md §3.7): source ranks needed by destination ``rank_id``.

    ``src`` is the source layout map built with ``rank_id=None``; ``dst`` must be the rank-aware
    map of ``rank_id`` (docs/formats.md §2.4). MindSpore takes "the device number of a stage" from the first
    layout item; by default that is the first value of each mapping (``layout_map`` keeps file
    order). Pass the item (or its device number) as ``src_first`` / ``dst_first`` to override it.
    The result is MindSpore's: the union over parameters of their needed local ranks (fake slice
    shape ``[max(N_src, N_dst)] * ndim``), replicated into every source stage that holds any
    remaining parameter, descending.
    """
    if src is None:
        return [0]
    n_dst = _device_num(dst_first, dst, "destination") if dst else 1
    view = _stage_view(src, dst if dst else None, rank_id // n_dst if dst else None)
    n_src = _device_num(src_first, src, "source")
    local = rank_id % n_dst if n_dst > 1 else rank_id
    need: set[int] = set()
    for name, src_p, dst_p in view.pairs:
        try:
            need |= _param_need(src_p, dst_p, local)
        except LayoutError as exc:
            raise LayoutError(f"parameter {name!r}: {exc.detail}") from None
    return sorted({s * n_src + x for s in view.stages for x in need}, reverse=True)


__all__ = ["rank_list_for_transform"]
