"""The layout types: how a strategy file says one parameter is sharded, as plain frozen values.

They live at the bottom of the house, below every reader, so that the slice algebra, the planners
and the tests can build and compare layouts without loading protobuf or any file format:
``reshard.formats.strategy`` builds them from the bytes of a strategy file, and everything above
reads them. ``LayoutTable`` is what the layout layer needs from a strategy (its layout items by
stored name, and the file they came from, for error messages); ``StrategyFile`` satisfies it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

TensorMapEntry = int | tuple[int, ...]


@dataclass(frozen=True)
class ParamLayout:
    """One ``parallel_layout_item`` of a strategy file, as stored (no interpretation yet).

    ``tensor_map`` holds one entry per tensor dimension: an ``int`` for flat maps, or a tuple of
    device-axis values for Layout-API list maps (MindSpore writes one TensorMap per dim then; empty
    ones, such as the extra one of 1-D tensors, are dropped as ``_convert_to_list`` does).
    Values count device axes from the right (0 = innermost), -1 = not split.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    field: int = 0
    split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    @property
    def is_list_map(self) -> bool:
        return any(isinstance(e, tuple) for e in self.tensor_map)


@dataclass(frozen=True)
class StagedLayout:
    """A parameter's layout together with every pipeline stage that holds it (docs/formats.md §2.4)."""

    layout: ParamLayout
    stages: tuple[int, ...]


class LayoutTable(Protocol):
    """A strategy as the layout layer reads it (``reshard.formats.strategy.StrategyFile`` is one).

    ``layouts`` maps each layout item's stored name (``"<stage>-<name>"`` in merged files) to its
    layout, in file order; ``path`` names the file in error messages (None: built in memory).
    """

    @property
    def layouts(self) -> Mapping[str, ParamLayout]: ...

    @property
    def path(self) -> str | None: ...


__all__ = ["LayoutTable", "ParamLayout", "StagedLayout", "TensorMapEntry"]
