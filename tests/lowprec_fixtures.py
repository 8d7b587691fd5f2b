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


BF16_Q = "model.layers.0.self_attn.q_proj.weight"  # quantized: 300 x 260, partial edge blocks, one all-zero block
NOT_Q = ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight", "lm_head.weight")


def bf16_model(folder: Path, seed: int = 1) -> Path:
    """A Hugging Face folder of bf16 tensors for ``--quantize``: one linear weight and the kinds the rule skips."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((300, 260)) * 0.05
    q[:128, 128:256] = 0  # an all-zero block: scale 1, values 0
    q[5, 7] = 40.0  # one large value: its block's scale follows it, the rest of the block rounds to small values
    t = {
        NOT_Q[0]: rng.standard_normal((50, 64)),
        BF16_Q: q,
        NOT_Q[1]: rng.standard_normal((8, 64)),
        NOT_Q[2]: rng.standard_normal(64),
        NOT_Q[3]: rng.standard_normal((50, 64)),
    }
    save_safetensors(
        folder / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}, {"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return folder


# Run in the transformers venv: DeepSeek's rule computed in torch. ARGS = {"src", "out", "name", "block"}.
QUANTIZE_RULE = """
from safetensors.torch import load_file
raw = load_file(os.path.join(ARGS["src"], "model.safetensors"))
got = load_file(os.path.join(ARGS["out"], "model.safetensors"))
name, (b0, b1) = ARGS["name"], ARGS["block"]
w = raw[name].float()
rows, cols = w.shape
n0, n1 = -(-rows // b0), -(-cols // b1)
padded = torch.zeros(n0 * b0, n1 * b1)
padded[:rows, :cols] = w
grid = padded.reshape(n0, b0, n1, b1)
amax = grid.abs().amax(dim=(1, 3))
scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
values = (grid / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n0 * b0, n1 * b1)
values = values[:rows, :cols]
out({"values": torch.equal(values.view(torch.uint8), got[name].view(torch.uint8)),
     "scales": torch.equal(scale.view(torch.int32), got[name + "_scale_inv"].view(torch.int32)),
     "dtypes": [str(got[name].dtype), str(got[name + "_scale_inv"].dtype)]})
"""

# Run in the transformers venv: load ARGS["quantized"] with FineGrainedFP8Config(dequantize=True) and compare its
# weights with ARGS["dequantized"] (reshard's --dequantize bf16 of the same files). transformers checks that
# `accelerate` is installed before loading any FP8 model, though dequantizing on CPU never uses it: the check is
# skipped when accelerate is absent.
LOAD_FP8 = """
import importlib.util
from safetensors.torch import load_file
from transformers.quantizers import quantizer_finegrained_fp8 as fp8
if importlib.util.find_spec("accelerate") is None:
    fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
model = transformers.AutoModelForCausalLM.from_pretrained(
    ARGS["quantized"], quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
state = model.state_dict()
ref = load_file(os.path.join(ARGS["dequantized"], "model.safetensors"))
differ = [k for k, v in ref.items() if not torch.equal(state[k].view(torch.int16), v.view(torch.int16))]
out({"compared": len(ref), "differ": differ})
"""


# Pairs a strategy can cut on the 128x128 block grid (resharding pairs as pairs): rows and columns cut in
# two, the far edge of an uncut axis partial, and stacked experts cut along their first axis.
UP = "model.layers.0.mlp.up_proj.weight"  # 512 x 256
DOWN = "model.layers.0.mlp.down_proj.weight"  # 300 x 256: the rows' last block partial
STACKED = "model.layers.0.mlp.experts.weight"  # 4 x 256 x 128
PAIRED_SHAPES = {UP: (512, 256), DOWN: (300, 256), STACKED: (4, 256, 128)}


def paired_tensors(seed: int = 2) -> dict[str, np.ndarray]:
    """FP8 pairs (finite E4M3 bytes, F32 scales) for ``PAIRED_SHAPES``, beside ``fp8_tensors``' Q and K."""
    rng = np.random.default_rng(seed)
    out = fp8_tensors(seed)
    for name, shape in PAIRED_SHAPES.items():
        magnitude = rng.integers(0, 0x7F, shape, dtype=np.uint8)
        out[name] = (magnitude | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)).view(ml_dtypes.float8_e4m3fn)
        grid = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
        out[name + "_scale_inv"] = (rng.random(grid, dtype=np.float32) * 0.01 + 1e-4).astype(np.float32)
    return out


def dequantized(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """float32 ``weight * scale`` per block (edge blocks partial): the rule in numpy, for comparisons."""
    rows, cols = weight.shape[-2:]
    full = np.repeat(np.repeat(scale.astype(np.float32), block[0], -2), block[1], -1)[..., :rows, :cols]
    return weight.astype(np.float32) * full
