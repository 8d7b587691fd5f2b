"""Pipeline stages of a strategy: the name -> layout map MindSpore builds, stage and device counts.

A merged strategy names each layout item ``"<stage>-<name>"`` (docs/formats.md §2.5); a parameter shared by
several stages (tied embeddings) appears once per stage. Which of its layouts applies, how many
stages there are and how many devices a stage has are questions about layout items only, so they
are answered here, on any ``LayoutTable``, without reading a file: the planners ask them for every
destination rank, and ``reshard.formats.strategy`` only has to build the table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from reshard.errors import LayoutError
from reshard.layout.types import LayoutTable, ParamLayout, StagedLayout

# Merged files name each layout item "<stage>-<param>" (docs/formats.md §2.5).
STAGE_SEPARATOR = "-"
_STAGE_PREFIX = re.compile(r"[0-9]+")


def split_stage_name(name: str, path: str | None = None) -> tuple[int, str]:
    """``"3-emb"`` -> ``(3, "emb")``; a name without ``-`` is stage 0."""
    if STAGE_SEPARATOR not in name:
        return 0, name
    stage, _, origin = name.partition(STAGE_SEPARATOR)
    if stage.isascii() and stage.isdigit() and origin and STAGE_SEPARATOR not in origin:
        return int(stage), origin  # the common case, without the regular expression (planning 4 096 ranks)
    parts = name.split(STAGE_SEPARATOR)
    if len(parts) != 2 or not _STAGE_PREFIX.fullmatch(parts[0]) or not parts[1]:
        raise LayoutError(
            f"parameter name {name!r} is not '<stage>-<name>': names containing '-' cannot be used in"
            " strategy files (MindSpore splits them at '-')",
            path,
        )
    return int(parts[0]), parts[1]


def has_shared_names(sf: LayoutTable, lmap: Mapping[str, StagedLayout]) -> bool:
    """Whether a parameter is held by several stages (``lmap = layout_map(sf)``): only then does
    ``layout_map(sf, rank_id)`` depend on ``rank_id`` (without, it equals ``lmap`` for every rank)."""
    return len(lmap) != len(sf.layouts)


def layout_map(sf: LayoutTable, rank_id: int | None = None) -> dict[str, StagedLayout]:
    """``_convert_to_list``: origin name -> layout + every stage holding it, in first-appearance order.

    A parameter present in several stages (``0-emb``, ``1-emb``) accumulates the stages; the kept
    layout is, on each later occurrence with stage ``s`` and ``n = prod(its dev matrix)``:
    without ``rank_id`` the new one if ``s`` is the smallest stage so far; with ``rank_id`` the new one
    if ``rank_id // n == 0 and s == 0`` or ``rank_id // n > 0 and s > 0`` (MindSpore's rule,
    verified against ``_convert_to_list``).
    """
    layouts: dict[str, ParamLayout] = {}
    stages: dict[str, list[int]] = {}
    for name, layout in sf.layouts.items():
        stage, origin = split_stage_name(name, sf.path)
        if origin not in layouts:
            layouts[origin], stages[origin] = layout, [stage]
            continue
        seen = stages[origin]
        seen.append(stage)
        if _replaces(stage, seen, layout, rank_id, sf.path):
            layouts[origin] = layout
    return {name: StagedLayout(layouts[name], tuple(stages[name])) for name in layouts}


def _replaces(stage: int, seen: list[int], layout: ParamLayout, rank_id: int | None, path: str | None) -> bool:
    if rank_id is None:
        return stage <= min(seen)
    n = layout.device_num
    if n <= 0:
        raise LayoutError(f"device matrix {list(layout.dev_matrix)} has a zero dimension", path)
    group = rank_id // n
    return (group == 0 and stage == 0) or (group > 0 and stage > 0)


def stage_count(sf: LayoutTable, lmap: Mapping[str, StagedLayout] | None = None) -> int:
    """Number of pipeline stages: distinct stages over all layouts, which must be exactly 0..k-1.

    ``lmap``: ``layout_map(sf)`` when the caller has it already (it is not built again).
    """
    found = {s for staged in (layout_map(sf) if lmap is None else lmap).values() for s in staged.stages}
    if not found:
        raise LayoutError("strategy has no parameter layouts", sf.path)
    if found != set(range(len(found))):
        raise LayoutError(f"pipeline stages {sorted(found)} are not 0..{len(found) - 1}", sf.path)
    return len(found)


def device_num(sf: LayoutTable, lmap: Mapping[str, StagedLayout] | None = None) -> int:
    """Devices per stage: ``prod(dev_matrix)`` of the first parameter of ``layout_map(sf)``.

    That is MindSpore's ``_get_device_num_from_strategy`` (verified): the first entry of the
    converted map, whose layout is its smallest stage's, not necessarily the first item of the file.
    ``lmap``: ``layout_map(sf)`` when the caller has it already (it is not built again).
    """
    lmap = layout_map(sf) if lmap is None else lmap
    if not lmap:
        raise LayoutError("strategy has no parameter layouts", sf.path)
    name, first = next(iter(lmap.items()))
    if not first.layout.dev_matrix:
        raise LayoutError(f"parameter {name!r} has an empty device matrix", sf.path)
    return math.prod(first.layout.dev_matrix)


__all__ = ["STAGE_SEPARATOR", "device_num", "has_shared_names", "layout_map", "split_stage_name", "stage_count"]
