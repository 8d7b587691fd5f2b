"""FP8 block pairs in a DCP output cut into even row parts (``--dcp-ranks N``): each data file's pair its own.

A destination strategy lays every block scale out as its weight (``plan.quantized.paired_layouts``), and
rank folders written as DCP keep the source's slices, so both give each data file the scale blocks of
exactly its part of the weight. ``--dcp-ranks N`` is different: it cuts dim 0 of every tensor on its own,
like ``torch.chunk``, so a 512-row weight in 3 parts is cut at rows 171 and 342 while its 4-row scale is
cut after 2 block rows: the global tensors are right, but no file holds a pair a reader could use alone.

So ``block_grains`` cuts each 2-D FP8 weight in whole block rows instead (``EvenRows.grains``): its
block rows are shared out as ``torch.chunk`` shares rows, so part ``k`` of the weight holds exactly the
blocks part ``k`` of its scale scales (a 576-row weight of 128-row blocks in 2 parts: rows 0-384 and
384-576, scale rows 0-3 and 3-5). ``check_even_rows`` then runs on the full plan before it is cut into
chunks (nothing is written yet): every part of an FP8 weight must start on a multiple of the block's
rows and its scale's part must be exactly the blocks of those rows; otherwise (a block size that is not
known) the run is refused in one line naming the tensor, the cut and the block. Stacked (3-D and more)
pairs and MXFP4 pairs are cut along the same leading axis as their scales, so they always agree;
``--dequantize`` leaves no pair to cut.

A DCP folder has no ``config.json`` of its own, so one written from an FP8 model used to lose its block
size: reading it back (``--dequantize``, ``verify --dequantize``, another ``--dcp-ranks``) needed
``--block-size`` although reshard had known the size when it wrote the folder. ``config_for_dcp`` gives the
``config.json`` a DCP output of FP8 pairs carries beside its ``.metadata`` (torch's loaders ignore it; reshard
reads it as it reads a Hugging Face folder's): the source's own config when it had one, its
``quantization_config`` saying the block the pairs are stored in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from reshard import dtypes
from reshard.errors import UsageError
from reshard.layout import Box
from reshard.plan.dcp import Chunking, EvenRows, placements
from reshard.plan.model import Plan, TensorPlan
from reshard.plan.output_config import quantization_config
from reshard.plan.quantized import SCALE_INV, Block
from reshard.text import indefinite


def block_grains(full: Plan, how: Chunking, block: Callable[[], Block | None]) -> Chunking:
    """``how`` with each 2-D FP8 weight that has a block scale cut in whole block rows (``--dcp-ranks N``).

    Raises:
        UsageError: The block size unknown for a weight the cut would split.
    """
    if not isinstance(how, EvenRows) or how.parts < 2:
        return how
    tensors = {t.name: t for f in full.files for t in f.tensors}
    grains = {}
    for name, t in tensors.items():
        paired = name + SCALE_INV in tensors and t.dtype in dtypes.FP8_WEIGHTS and len(t.shape) == 2
        if paired and len(placements(t, how, [0])) > 1:
            grains[name] = _block_rows(name, how, block)
    return EvenRows(how.parts, {**how.grains, **grains}) if grains else how


def check_even_rows(full: Plan, how: Chunking, block: Callable[[], Block | None]) -> None:
    """Refuse a ``--dcp-ranks`` cut that gives some data file a part of an FP8 weight without its blocks' scales.

    ``full``: the plan of full tensors about to be re-cut (``plan.dcp.dcp_plan``); ``block``: the FP8
    block size (asked only when a 2-D weight's rows are cut).

    Raises:
        UsageError: A cut off the block grid, or the block size unknown for a cut weight.
    """
    if not isinstance(how, EvenRows) or how.parts < 2:
        return
    tensors = {t.name: t for f in full.files for t in f.tensors}
    for name, t in tensors.items():
        scale = tensors.get(name + SCALE_INV)
        if scale is None or t.dtype not in dtypes.FP8_WEIGHTS or len(t.shape) < 2:
            continue
        weights, scales = dict(placements(t, how, [0])), dict(placements(scale, how, [0]))
        if len(t.shape) > 2 or len(weights) < 2:
            continue  # stacked: the experts' axis is cut alike in both; one part: nothing cut
        rows = _block_rows(name, how, block)
        if scale.shape[0] != -(-t.shape[0] // rows):
            raise UsageError(
                f"{scale.name}: shape {list(scale.shape)} does not fit weight {name} {list(t.shape)} in "
                f"{rows}-row blocks (expected {-(-t.shape[0] // rows)} rows)"
            )
        for rank, box in weights.items():
            if scales.get(rank) != _blocks_of(name, t.shape[0], scale, box, rows, how, rank):
                raise UsageError(
                    f"{name}: --dcp-ranks {how.parts} cuts its block scale {scale.name} apart from it "
                    f"(rank {rank}): give --dequantize or a --dst-strategy"
                )


def _block_rows(name: str, how: EvenRows, block: Callable[[], Block | None]) -> int:
    rows = (block() or (None, None))[0]
    if rows is None:
        raise UsageError(
            f"{name}: --dcp-ranks {how.parts} cuts this FP8 weight's rows, and its block size is unknown: "
            "no config.json beside the source gives quantization_config.weight_block_size "
            "(give --block-size, e.g. 128x128)"
        )
    return rows


def _blocks_of(name: str, edge: int, scale: TensorPlan, box: Box, rows: int, how: EvenRows, rank: int) -> Box:
    """The scale box holding the blocks of weight rows ``box`` (whole columns; the far ``edge`` may end a
    partial block), or refused off the grid."""
    (a, b), _ = box
    for at in (a, b):
        if at % rows and at != edge:
            raise UsageError(
                f"{name}: --dcp-ranks {how.parts} cuts it at row {at} (rank {rank}), not on "
                f"{indefinite(rows)}-row block boundary of its scale {scale.name}: give --dequantize (exact at any "
                f"cut), a --dcp-ranks whose parts are multiples of {rows} rows, or a --dst-strategy"
            )
    return (a // rows, -(-b // rows)), (0, scale.shape[1])


def fp8_pairs(plan: Plan) -> list[str]:
    """The FP8 block-scaled weights ``plan`` writes as pairs (the weight and its ``_scale_inv`` both out)."""
    names = {t.name for f in plan.files for t in f.tensors}
    return [
        t.name for f in plan.files for t in f.tensors if t.dtype in dtypes.FP8_WEIGHTS and t.name + SCALE_INV in names
    ]


def config_for_dcp(
    block: Block | None, config: Mapping[str, object] | None, requantized: bool
) -> dict[str, object] | None:
    """The ``config.json`` of a DCP output holding FP8 pairs stored in ``block`` (None: the block is unknown).

    ``config``: the source's ``config.json`` (None: none), copied. Its ``quantization_config`` becomes
    ``--quantize``'s (``requantized``); else it keeps its keys and says ``weight_block_size`` (the block given
    with ``--block-size`` when it had none), or is DeepSeek-V3's for ``block`` when the source had none.
    """
    if block is None or block[0] is None or block[1] is None:
        return None
    size = [block[0], block[1]]
    doc = dict(config or {})
    stored = doc.get("quantization_config")
    if requantized or not isinstance(stored, dict):
        doc["quantization_config"] = quantization_config((size[0], size[1]))
    else:
        doc["quantization_config"] = {**stored, "weight_block_size": size}
    return doc


__all__ = ["block_grains", "check_even_rows", "config_for_dcp", "fp8_pairs"]
