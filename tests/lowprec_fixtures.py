"""Small block-scaled checkpoints made with numpy: FP8 block pairs (edge blocks partial) and an MXFP4 pair.

``fp8_model`` writes a Hugging Face folder (``model.safetensors``, its index, ``config.json`` with a
``quantization_config``) whose FP8 weights are random bytes (every E4M3 value, NaN included) and whose
scales are small positive floats; options spoil it for the bad-input tests. ``REFERENCES`` is the
script the transformers venv runs to compute what torch's ``QuantizedHuggingFaceStorageReader`` and
transformers' ``convert_moe_packed_tensors`` make of the same files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from reshard.formats.safetensors import save_safetensors

Q = "model.layers.0.self_attn.q_proj.weight"  # 300 x 260: partial edge blocks on both axes
K = "model.layers.0.self_attn.k_proj.weight"  # 130 x 256, BF16 scales
NORM = "model.norm.weight"
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # MXFP4 [2, 6, 3, 16] -> [2, 96, 6]
SHAPES = {Q: (300, 260), K: (130, 256)}


def fp8_tensors(
    seed: int = 0, block: tuple[int, int] = (128, 128), mxfp4_exponents: tuple[int, int] = (110, 140)
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, (rows, cols) in SHAPES.items():
        out[name] = rng.integers(0, 256, (rows, cols), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        scale = (rng.random(grid, dtype=np.float32) * 0.01 + 1e-4).astype(np.float32)
        out[name + "_scale_inv"] = scale.astype(ml_dtypes.bfloat16) if name == K else scale
    out[NORM] = rng.standard_normal(64).astype(ml_dtypes.bfloat16)
    out[EXPERTS + "_blocks"] = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)
    lo, hi = mxfp4_exponents
    out[EXPERTS + "_scales"] = rng.integers(lo, hi, (2, 6, 3), dtype=np.uint8)
    return out


def fp8_model(
    folder: Path,
    tensors: dict[str, np.ndarray] | None = None,
    *,
    block: tuple[int, int] | None = (128, 128),
    drop: tuple[str, ...] = (),
) -> Path:
    """A Hugging Face folder of ``tensors`` (default ``fp8_tensors()``), without the names in ``drop``.

    ``block=None``: config.json has no ``weight_block_size``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in (tensors if tensors is not None else fp8_tensors()).items() if k not in drop}
    save_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    quant: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "quantization_config": quant}))
    index = {"metadata": {"total_size": 0}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


# Run in the transformers venv: ARGS = {"src", "out", "dtype"}; writes the references to ARGS["out"].
REFERENCES = """
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
dtype = getattr(torch, ARGS["dtype"])
raw = load_file(os.path.join(ARGS["src"], "model.safetensors"))
fp8 = {k: torch.empty(v.shape, dtype=dtype) for k, v in raw.items() if v.dtype == torch.float8_e4m3fn}
dcp.load(fp8, storage_reader=QuantizedHuggingFaceStorageReader(ARGS["src"], target_dtype=dtype, block_size=128),
         no_dist=True)
for stem in [k[: -len("_blocks")] for k in raw if k.endswith("_blocks")]:
    fp8[stem] = convert_moe_packed_tensors(raw[stem + "_blocks"], raw[stem + "_scales"], dtype=dtype)
save_file({k: v.contiguous() for k, v in fp8.items()}, ARGS["out"])
out({"tensors": sorted(fp8)})
"""
