"""What ``reshard inspect`` shows of block-scaled pairs: plain data from names, dtypes and shapes.

Apart from ``reshard.plan.quantized`` (which plans dequantizing, quantizing and resharding pairs)
because it is a view for people, not a planning rule: each FP8 block weight or MXFP4 pair shown
as one quantized weight (format, block size, scale tensor), counted once in the summary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reshard import dtypes
from reshard.errors import UsageError
from reshard.plan.model import SourceFile
from reshard.plan.quantized import BLOCKS, FP8_BLOCK, MXFP4, SCALE_INV, SCALES, block_from_config


def quantized_names(sources: Sequence[SourceFile]) -> bool:
    """Whether any source holds a block-scaled pair (a ``*_scale_inv`` or MXFP4 ``*_scales`` tensor)."""
    return any(n.endswith((SCALE_INV, SCALES)) for sf in sources for n in sf.tensors)


def quantized_view(rows: Sequence[Mapping[str, Any]], block: tuple[int, int] | None) -> dict[str, dict[str, object]]:
    """Each stored tensor of a block-scaled pair among ``rows`` (inspect's ``name``/``dtype``/``shape`` rows).

    A weight maps to ``{"format", "block", "scale", "values"}`` (``values``: what its bytes hold, two a byte for
    MXFP4), a scale to ``{"scale_of": weight}``; other tensors are absent. ``block``: the FP8 block size of the
    model's config.json (None: unknown, shown so).
    """
    dtype_of = {str(r["name"]): str(r["dtype"]) for r in rows}
    shape_of = {str(r["name"]): tuple(r.get("full_shape") or r.get("shape") or ()) for r in rows}
    fp8 = {d.ms_name for d in dtypes.FP8_WEIGHTS}
    out: dict[str, dict[str, object]] = {}
    for name in dtype_of:
        if name.endswith(SCALE_INV) and dtype_of.get(name[: -len(SCALE_INV)]) in fp8:
            weight = name[: -len(SCALE_INV)]
            shown = list(block) if block is not None else None
            values = math.prod(shape_of[weight])
            out[weight] = {"format": FP8_BLOCK, "block": shown, "scale": name, "values": values}
            out[name] = {"scale_of": weight}
        elif name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS in dtype_of:
            blocks = name[: -len(SCALES)] + BLOCKS
            values = math.prod(shape_of[blocks]) * dtypes.LOW_PRECISION["MXFP4"].values_per_item
            out[blocks] = {"format": MXFP4, "block": [dtypes.MXFP4_BLOCK], "scale": name, "values": values}
            out[name] = {"scale_of": blocks}
    return out


def counted_once(
    summary: dict[str, Any],
    view: Mapping[str, Mapping[str, object]],
    rows: Sequence[Mapping[str, Any]],
    is_state: Callable[[str], object],
) -> None:
    """Inspect's summary with each pair one parameter: scales not counted, MXFP4 bytes as their two values.

    ``rows``: every rank's tensor rows; ``is_state(name)``: truthy for training state (not a parameter). The
    elements are the full tensors' (a rank's slices need ``full_shape``: a scale the strategy leaves out has
    its weight's layout, so only its weight's full shape counts).
    """
    if not view:
        return
    first: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        first.setdefault(str(row["name"]), row)
    weights = [n for n in first if not is_state(n) and "scale_of" not in view.get(n, {})]
    summary["parameters"] = len(weights)
    sliced = summary.get("source") == "distributed" and (summary.get("ranks") or 0) > 1
    shapes: list[Sequence[int] | None] = [
        first[n].get("full_shape") or (None if sliced else first[n].get("shape")) for n in weights
    ]
    if any(shape is None for shape in shapes):
        return  # a rank's slices without a strategy: the full shapes are unknown
    per_value = {n: int(str(view[n]["values"])) for n in weights if "values" in view.get(n, {})}
    summary["parameter_elements"] = sum(
        per_value.get(n, math.prod(s or ())) for n, s in zip(weights, shapes, strict=True)
    )


def quantized_lines(view: Mapping[str, Mapping[str, object]]) -> list[str]:
    """``quantized: 61 FP8 block weight(s) (128x128 blocks, scales in *_scale_inv); 2 MXFP4 ...`` (none: [])."""
    parts = []
    fp8 = [q for q in view.values() if q.get("format") == FP8_BLOCK]
    if fp8:
        sizes = sorted({_block_text(q["block"]) for q in fp8})
        parts.append(f"{len(fp8)} FP8 block weight(s) ({', '.join(sizes)}, scales in *{SCALE_INV})")
    mx = [q for q in view.values() if q.get("format") == MXFP4]
    if mx:
        parts.append(f"{len(mx)} MXFP4 weight(s) ({dtypes.MXFP4_BLOCK} values a block, scales in *{SCALES})")
    return [f"quantized: {'; '.join(parts)}; each pair counted once"] if parts else []


def quantized_dtype(dtype: str, q: Mapping[str, object] | None) -> str:
    """Inspect's dtype column of a tensor: ``F8 ... fp8-block 128x128`` for a weight, ``... scale`` for its scale."""
    if q is None:
        return dtype
    if "scale_of" in q:
        return f"{dtype} (block scale)"
    return f"{dtype} ({q['format']}, {_block_text(q['block'])})"


def _block_text(block: object) -> str:
    """``128x128 blocks``, ``32 values a block`` (MXFP4), or ``block size unknown`` (no config.json says it)."""
    if not isinstance(block, list):
        return "block size unknown"
    return f"{block[0]} values a block" if len(block) == 1 else "x".join(str(b) for b in block) + " blocks"


def config_block(path: str) -> tuple[int, int] | None:
    """The FP8 block size in the ``config.json`` at ``path`` (``sources.config_path``; None: none, or not readable)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return block_from_config(doc if isinstance(doc, dict) else None)
    except (OSError, ValueError, UsageError):
        return None


__all__ = ["config_block", "counted_once", "quantized_dtype", "quantized_lines", "quantized_names", "quantized_view"]
