"""The ``config.json`` written beside a Hugging Face output: the user's copy, told how the weights are stored now.

Why it is edited at all: transformers (and vLLM) read from ``config.json`` how the weights are stored, not
from the weights: ``quantization_config`` says which linear layers hold FP8 blocks, and ``torch_dtype``
(``dtype`` since transformers 5) the dtype a model loads in. A config copied as it was describes the
source: after ``--dtype bf16`` transformers loaded the bf16 weights as float32, after ``--quantize`` with
every weight excluded it looked for scales that were never written, and after ``--quantize`` with the
experts excluded it made FP8 layers of them and reported their scales missing.

What is changed, and only that (the rest of the user's file is kept as it was):

* ``quantization_config``: dropped when the output holds no FP8 pair (``--dequantize``, or ``--quantize``
  that quantized nothing); DeepSeek-V3's keys with the block when it holds some, and
  ``modules_to_not_convert`` naming every 2-D ``*.weight`` float left unquantized, each as the highest
  module holding no quantized weight (transformers' rule: a name stands for the modules under it; layer
  ``1`` is not layer ``11``). All of them, the rule's own too (the head, routers): a list given replaces
  the loader's default (the output head alone), and a router that is a linear layer (Mixtral's
  ``block_sparse_moe.gate``) would otherwise be made an FP8 layer whose scale is nowhere.
* ``torch_dtype`` / ``dtype``, where the file has them: the dtype of the output's floating tensors, when
  they (FP8 pairs aside) have one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from reshard import dtypes
from reshard.dtypes import DType
from reshard.plan.quantized import SCALE_INV

DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers 4's name of the load dtype, and 5's
Tensor = tuple[str, DType, tuple[int, ...]]  # (name, dtype, shape) of an output tensor


def quantization_config(block: tuple[int, int], not_converted: Iterable[str] = ()) -> dict[str, object]:
    """The ``quantization_config`` of FP8 block-scaled weights (DeepSeek-V3's keys), with the modules a loader
    must leave as they are when there are any."""
    doc: dict[str, object] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    kept = list(not_converted)
    if kept:
        doc["modules_to_not_convert"] = kept
    return doc


def modules_not_converted(tensors: Iterable[Tensor]) -> list[str]:
    """The modules an FP8 loader must not convert: each unquantized ``*.weight`` float of two dims stands for
    its module (the name less ``.weight``), widened to the highest module that holds no quantized weight
    (none when ``tensors`` hold no FP8 pair).

    Example:
        from reshard.dtypes import BFLOAT16 as B, FLOAT8_E4M3 as F8, FLOAT32 as F
        ts = [("m.0.experts.1.w.weight", B, (4, 4)), ("m.0.q.weight", F8, (4, 4)),
              ("m.0.q.weight_scale_inv", F, (1, 1)), ("lm_head.weight", B, (8, 4))]
        assert modules_not_converted(ts) == ["lm_head", "m.0.experts"]
    """
    names: dict[str, tuple[DType, tuple[int, ...]]] = {name: (dtype, shape) for name, dtype, shape in tensors}
    quantized = {name.removesuffix(".weight") for name in names if name + SCALE_INV in names}
    if not quantized:
        return []
    kept = [
        name.removesuffix(".weight")
        for name, (dtype, shape) in names.items()
        if name.endswith(".weight") and dtype in dtypes.CASTABLE and len(shape) == 2 and name + SCALE_INV not in names
    ]
    taken = {prefix for module in quantized for prefix in _prefixes(module)}
    return sorted({_widest(module, taken) for module in kept})


def _prefixes(module: str) -> list[str]:
    """``module`` and the modules above it, highest first (``a``, ``a.b``, ``a.b.c``)."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _widest(module: str, taken: set[str]) -> str:
    """The highest module above (or at) ``module`` that is not ``taken`` (holds no quantized weight)."""
    return next((prefix for prefix in _prefixes(module) if prefix not in taken), module)


def load_dtype(tensors: Iterable[Tensor]) -> DType | None:
    """The one dtype of the output's floating tensors (FP8 pairs' weights and scales aside), or None."""
    seen = {dtype for name, dtype, _ in tensors if dtype in dtypes.CASTABLE and not name.endswith(SCALE_INV)}
    return seen.pop() if len(seen) == 1 else None


def rewritten(
    raw: bytes,
    tensors: Iterable[Tensor],
    *,
    quantized: tuple[int, int] | None = None,
    dequantized: bool = False,
    cast: bool = False,
) -> bytes:
    """``raw`` (a ``config.json``) as it must read beside ``tensors`` (module docstring); ``raw`` itself when
    nothing changes, or when it is not a JSON object.

    ``quantized``: the run quantized (``--quantize``) with this block; ``dequantized``: it dequantized;
    ``cast``: some run flag changed dtypes (the load dtype is set then, never otherwise). A model whose
    pairs were carried as they are keeps its ``quantization_config`` (its own keys, an MXFP4 one).
    """
    listed = list(tensors)
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        return raw
    before = json.loads(raw)
    if dequantized:
        doc.pop("quantization_config", None)
    elif quantized is not None:
        doc.pop("quantization_config", None)
        if any(name.endswith(SCALE_INV) for name, _, _ in listed):
            doc["quantization_config"] = quantization_config(quantized, modules_not_converted(listed))
    dtype = load_dtype(listed) if cast or dequantized or quantized is not None else None
    for key in DTYPE_KEYS:
        if key in doc and dtype is not None:
            doc[key] = dtype.numpy_name
    if doc == before:
        return raw
    return (json.dumps(doc, indent=2) + "\n").encode()


__all__ = [
    "DTYPE_KEYS",
    "Tensor",
    "load_dtype",
    "modules_not_converted",
    "quantization_config",
    "rewritten",
]
