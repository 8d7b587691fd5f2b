"""Strategy files (protobuf ``.ckpt`` and ``.json``) -> per-parameter layouts.

(Being written: the reader/writer/merger land here. The data classes below are the contract the
layout engine builds on.)
"""

from __future__ import annotations

from dataclasses import dataclass

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
        n = 1
        for d in self.dev_matrix:
            n *= d
        return n

    @property
    def is_list_map(self) -> bool:
        return any(isinstance(e, tuple) for e in self.tensor_map)


@dataclass(frozen=True)
class StagedLayout:
    """A parameter's layout together with every pipeline stage that holds it (spec 2.4)."""

    layout: ParamLayout
    stages: tuple[int, ...]
