"""Block-scaled pairs through a model map: a renamed weight keeps its scale beside it, or the run is refused.

A model map (``--rename RULES``, a preset) works on tensor names one rule at a time, so it can rename an
FP8 weight ``X.weight`` and leave its scale ``X.weight_scale_inv`` under the old name, or stack, join,
split or transpose the weights while their scales stay as they were. The checkpoint written would hold
a weight no reader can dequantize: transformers, torch and vLLM find a weight's scale by its name and
its blocks by its shape. So after the map, every output that reads a stored pair's weight must read
that weight alone (a rename, cut by the destination strategy or not), and the same output file must
hold the scale under the weight's new name (``W'`` + ``_scale_inv``; MXFP4: ``P'_blocks`` beside
``P'_scales``) reading that pair's scale alone. A rule written for both (``model\\.(.*)`` -> ``m.\\1``)
passes; anything else is refused before any byte is written, naming the weight, what the map made of
it and of its scale, and the way out (``--dequantize``, which consumes the scales before the map).
The destination strategy then lays each renamed pair out as one (``paired_layouts`` on the map's
outputs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from reshard.errors import UnsupportedError
from reshard.plan.model import Plan, TensorPlan
from reshard.plan.quantized import BLOCKS, SCALE_INV, SCALES


def _scale_of(name: str) -> str | None:
    """The scale name beside a weight (or MXFP4 blocks) name; None for another name."""
    if name.endswith(BLOCKS):
        return name[: -len(BLOCKS)] + SCALES
    return name + SCALE_INV


def _reads(t: TensorPlan) -> set[str]:
    """The source tensors ``t`` reads; a reshaped or transposed read counts as a second one (refused)."""
    return {c.tensor for c in t.copies} | ({""} if any(c.src_view or c.src_perm for c in t.copies) else set())


def _shown(names: Iterable[str]) -> str:
    listed = sorted(names)
    return ", ".join(listed[:3]) + (f" and {len(listed) - 3} more" if len(listed) > 3 else "") if listed else "nothing"


def check_mapped_pairs(plan: Plan, map_name: str, pairs: Mapping[str, str]) -> None:
    """Refuse a plan whose model map broke a block-scaled pair of its sources (see the module).

    ``pairs``: each stored pair's weight (MXFP4: blocks) name -> its scale name, before the map.

    Raises:
        UnsupportedError: Naming the weight, the outputs the map made of it and of its scale.
    """
    if not pairs:
        return
    scales = {s: w for w, s in pairs.items()}
    for f in plan.files:
        by_name = {t.name: t for t in f.tensors}
        for t in f.tensors:
            reads = _reads(t)
            weights, own = sorted(reads & pairs.keys()), sorted(reads & scales.keys())
            if weights and (len(reads) > 1 or not _scale_beside(t.name, by_name, pairs[weights[0]])):
                _refuse(plan, weights[0], pairs, map_name)
            if own and (len(reads) > 1 or not _weight_beside(t.name, by_name, scales[own[0]])):
                _refuse(plan, scales[own[0]], pairs, map_name)


def _scale_beside(name: str, by_name: dict[str, TensorPlan], scale: str) -> bool:
    beside = _scale_of(name)
    return beside is not None and beside in by_name and _reads(by_name[beside]) == {scale}


def _weight_beside(name: str, by_name: dict[str, TensorPlan], weight: str) -> bool:
    return any(_scale_of(n) == name and _reads(t) == {weight} for n, t in by_name.items())


def _how(t: TensorPlan) -> str:
    reads = _reads(t)
    if "" in reads:
        return " (transposed or reshaped)"
    return f" (joined from {len(reads)} tensors)" if len(reads) > 1 else ""


def _refuse(plan: Plan, weight: str, pairs: Mapping[str, str], map_name: str) -> None:
    scale = pairs[weight]
    made = {t.name + _how(t) for f in plan.files for t in f.tensors if weight in _reads(t)}
    of_scale = {t.name + _how(t) for f in plan.files for t in f.tensors if scale in _reads(t)}
    raise UnsupportedError(
        f"{weight}: the model map ({map_name}) makes {_shown(made)} of this block-quantized weight but "
        f"{_shown(of_scale)} of its scale {scale}; a pair must be renamed alike and not split, joined, stacked or "
        "transposed: give --dequantize (the scales are consumed before the map), or a map whose rules rename "
        "both names alike"
    )


__all__ = ["check_mapped_pairs"]
