"""Slice ids: how MindFormers' Checkpoint 2.0 numbers the distinct blocks of a sharded tensor.

Checkpoint 2.0's ``metadata.json`` (docs/formats.md §10.2) does not store where a rank's block starts
in elements. It stores a *slice id*: the row-major index of the block in the grid whose shape is
the layout's ``axis_fragmentations`` (the number of blocks per tensor dimension), and a
``replica_id`` per rank (how many ranks before it in the layout's rank list hold the same block).
MindFormers derives both from the layout (``_get_global_offset_and_replica_id_from_layout``):
each tensor dimension's block coordinate is read off the device coordinates of the axes that
split it, the first listed axis of a multi-axis dimension being the major one. This module
computes the same numbers from a ``ParamLayout``, as pure functions, and says what a layout
becomes in a Checkpoint 2.0 (``model_parallel``: its optimizer shard dropped, since MindFormers'
layout dict has no place for one). The property tests check the ids against the block each rank
holds by ``reshard.layout.algebra``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from reshard.layout.algebra import NOT_SPLIT, opt_shard_size, tensor_strategy
from reshard.layout.stages import STAGE_SEPARATOR, split_stage_name
from reshard.layout.types import LayoutTable, ParamLayout


def model_parallel(p: ParamLayout) -> ParamLayout:
    """``p`` without its optimizer shard: the slice each rank holds for the forward pass.

    Args:
        p: A layout from a strategy file.

    Returns:
        The same layout with ``opt_shard_step`` and ``opt_shard_size`` zero (``p`` itself when it has none).

    Example:
        from reshard.layout import ParamLayout
        from reshard.layout.slices import model_parallel
        assert model_parallel(ParamLayout((2, 4), (-1, 0), 2, 2)).opt_shard_size == 0
    """
    if not (p.opt_shard_step or p.opt_shard_size):
        return p
    return replace(p, opt_shard_step=0, opt_shard_size=0)


def has_optimizer_shard(p: ParamLayout) -> bool:
    """Whether ``p`` shards data for the optimizer (what ``model_parallel`` drops; a group of one does not)."""
    return opt_shard_size(p) != 0


@dataclass(frozen=True)
class ModelParallelTable:
    """A strategy seen without optimizer shards (every layout through ``model_parallel``)."""

    table: LayoutTable

    @functools.cached_property
    def layouts(self) -> Mapping[str, ParamLayout]:
        return {name: model_parallel(p) for name, p in self.table.layouts.items()}

    @property
    def path(self) -> str | None:
        return self.table.path


@dataclass(frozen=True)
class CompletedTable:
    """A strategy plus layouts for training states it lacks, taken from their parameter's.

    A strategy saved by a job without optimizer (inference) has no ``adam_m.<p>`` entries; a
    transform would then copy each rank's *source* slice of them as if it were the whole tensor.
    MindFormers rebuilds a missing state's layout from its parameter's
    (``complete_optimizer_layout_index``); so does this table, for each name of ``names`` that it
    lacks and that ends in ``.<parameter>`` of a parameter it has (in every stage that has it).
    """

    table: LayoutTable
    names: tuple[str, ...]

    @functools.cached_property
    def layouts(self) -> Mapping[str, ParamLayout]:
        stored: dict[str, list[tuple[str, ParamLayout]]] = {}
        for key, p in self.table.layouts.items():
            stage, origin = split_stage_name(key, self.table.path)
            stored.setdefault(origin, []).append((str(stage) if STAGE_SEPARATOR in key else "", p))
        out = dict(self.table.layouts)
        for name in self.names:
            if name in stored:
                continue
            base = parameter_of(name, stored)
            for stage_prefix, p in stored.get(base, []) if base is not None else ():
                out[f"{stage_prefix}{STAGE_SEPARATOR}{name}" if stage_prefix else name] = p
        return out

    @property
    def path(self) -> str | None:
        return self.table.path


def parameter_of(name: str, parameters: Mapping[str, object]) -> str | None:
    """The parameter a state ``<prefix>.<parameter>`` belongs to: the first dot-suffix in ``parameters``.

    Example:
        from reshard.layout.slices import parameter_of
        assert parameter_of("adam_m.model.w", {"model.w": 1}) == "model.w"
    """
    dot = name.find(".")
    while dot != -1:
        if name[dot + 1 :] in parameters:
            return name[dot + 1 :]
        dot = name.find(".", dot + 1)
    return None


def axis_fragmentations(p: ParamLayout) -> tuple[int, ...]:
    """Blocks per tensor dimension (MindFormers' ``axis_fragmentations``; the optimizer shard is ignored)."""
    return tensor_strategy(model_parallel(p))


def _device_coordinates(dev_matrix: tuple[int, ...], index: int) -> tuple[int, ...]:
    """Coordinates of position ``index`` of the rank list along each device axis (row-major)."""
    coords = []
    for size in reversed(dev_matrix):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


@functools.lru_cache(maxsize=4096)
def slice_ids(p: ParamLayout) -> tuple[int, ...]:
    """The slice id of every position of the layout's rank list (``prod(dev_matrix)`` of them).

    Args:
        p: The layout (its optimizer shard, if any, is ignored).

    Returns:
        Per rank-list position, the row-major index of its block in the ``axis_fragmentations`` grid.

    Example:
        from reshard.layout import ParamLayout
        from reshard.layout.slices import slice_ids
        assert slice_ids(ParamLayout((2, 4), (-1, 0))) == (0, 1, 2, 3, 0, 1, 2, 3)
    """
    dev = p.dev_matrix
    n = len(dev)
    frags = axis_fragmentations(p)
    ids = []
    for index in range(math.prod(dev)):
        coords = _device_coordinates(dev, index)
        slice_id = 0
        for entry, blocks in zip(p.tensor_map, frags, strict=True):
            block = 0
            for value in entry if isinstance(entry, tuple) else (entry,):
                if value != NOT_SPLIT:
                    axis = n - 1 - value
                    block = block * dev[axis] + coords[axis]
            slice_id = slice_id * blocks + block
        ids.append(slice_id)
    return tuple(ids)


@functools.lru_cache(maxsize=4096)
def replica_ids(p: ParamLayout) -> tuple[int, ...]:
    """Per rank-list position, how many earlier positions hold the same block (MindFormers' ``replica_id``).

    Example:
        from reshard.layout import ParamLayout
        from reshard.layout.slices import replica_ids
        assert replica_ids(ParamLayout((2, 4), (-1, 0))) == (0, 0, 0, 0, 1, 1, 1, 1)
    """
    seen: dict[int, int] = {}
    out = []
    for slice_id in slice_ids(p):
        out.append(seen.get(slice_id, 0))
        seen[slice_id] = out[-1] + 1
    return tuple(out)


def alias_names(dev_matrix: tuple[int, ...]) -> tuple[str, ...]:
    """Names for the device axes, which strategy files do not carry: ``axis<k>``, ``k`` the value
    by which tensor maps name that axis (counted from the right: the last axis is ``axis0``).

    Example:
        from reshard.layout.slices import alias_names
        assert alias_names((2, 4)) == ("axis1", "axis0")
    """
    n = len(dev_matrix)
    return tuple(f"axis{n - 1 - i}" for i in range(n))


__all__ = [
    "CompletedTable",
    "ModelParallelTable",
    "alias_names",
    "axis_fragmentations",
    "has_optimizer_shard",
    "model_parallel",
    "parameter_of",
    "replica_ids",
    "slice_ids",
]
