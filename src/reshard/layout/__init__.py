"""The layout layer: which box of the full tensor each rank holds, and who supplies what.

Pure values and pure functions on them, importing nothing of reshard but ``errors`` (no file
format, no protobuf, no numpy), so that planners and tests can ask layout questions cheaply and
``import reshard.layout`` stays fast. Three modules:

* ``types`` — the layout types a strategy file is made of (``ParamLayout``, ``StagedLayout``,
  ``TensorMapEntry``) and ``LayoutTable``, what this layer reads from a strategy;
* ``stages`` — pipeline stages: the name -> layout map MindSpore builds (``layout_map``),
  ``stage_count``, ``device_num``;
* ``algebra`` — the slice algebra: boxes per rank, needed ranks, transfer pieces, redundancy;
* ``chunks`` — chunk boxes, the planning input of every format: a tensor as boxes of its global
  tensor held by tensors of files (``ChunkedTensor``), checked and intersected (``ChunkIndex``),
  compiled from MindSpore layouts, Checkpoint 2.0 grids and whole files, and destination chunkings.

Everything public is importable from ``reshard.layout`` itself.
"""

from reshard.layout.algebra import (
    Box,
    FlatLayout,
    Piece,
    box_volume,
    flat_layout,
    flat_rank_box,
    full_shape,
    needed_ranks,
    normalize_device_num,
    opt_shard_size,
    rank_box,
    rank_boxes,
    slice_shape,
    tensor_strategy,
    unsharded_flat,
)
from reshard.layout.chunks import (
    Chunk,
    ChunkedTensor,
    ChunkIndex,
    even_boxes,
    grid_boxes,
    grid_chunks,
    layout_chunks,
    whole_chunks,
)
from reshard.layout.rank_list import rank_list_for_transform
from reshard.layout.stages import (
    STAGE_SEPARATOR,
    device_num,
    has_shared_names,
    layout_map,
    split_stage_name,
    stage_count,
)
from reshard.layout.transfer import redundancy_groups, transfer_pieces, transfer_table
from reshard.layout.types import LayoutTable, ParamLayout, StagedLayout, TensorMapEntry

__all__ = [
    "STAGE_SEPARATOR",
    "Box",
    "Chunk",
    "ChunkIndex",
    "ChunkedTensor",
    "FlatLayout",
    "LayoutTable",
    "ParamLayout",
    "Piece",
    "StagedLayout",
    "TensorMapEntry",
    "box_volume",
    "device_num",
    "even_boxes",
    "flat_layout",
    "flat_rank_box",
    "full_shape",
    "grid_boxes",
    "grid_chunks",
    "has_shared_names",
    "layout_chunks",
    "layout_map",
    "needed_ranks",
    "normalize_device_num",
    "opt_shard_size",
    "rank_box",
    "rank_boxes",
    "rank_list_for_transform",
    "redundancy_groups",
    "slice_shape",
    "split_stage_name",
    "stage_count",
    "tensor_strategy",
    "transfer_pieces",
    "transfer_table",
    "unsharded_flat",
    "whole_chunks",
]
