"""Shared inputs of the Checkpoint 2.0 writing tests: a tiny model, its strategies, full tensors.

Layouts are ``ParamLayout`` values (tensor maps count device axes from the right, -1 = not split).
The default job is dp2 x tp4 (``DEV``): axis value 1 is dp (size 2), 0 is tp (size 4).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from reshard import layout
from reshard.formats.ckpt import save_ckpt
from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout

DEV = (2, 4)
EMB = "embedding.word_embeddings.weight"
PROJ = "decoder.layers.0.linear_proj.weight"
FC1 = "decoder.layers.0.linear_fc1.weight"
DP = "decoder.layers.0.dp_split.weight"
NORM = "decoder.layers.0.input_layernorm.weight"
POS = "decoder.layers.0.position_ids"  # in no strategy: copied whole to every rank

SHAPES: dict[str, tuple[tuple[int, ...], Any]] = {
    EMB: ((16, 8), np.float32),
    PROJ: ((8, 16), np.float32),
    FC1: ((16, 8), np.float32),
    DP: ((4, 6), np.float32),
    NORM: ((8,), ml_dtypes.bfloat16),
}


def layouts(dev: tuple[int, ...] = DEV, opt: bool = False) -> dict[str, ParamLayout]:
    """The model's layouts on ``dev`` (two axes); ``opt``: the 2-D weights optimizer-sharded over dp."""
    dp = dev[0]
    shard = (dev[1], dp) if opt and dp > 1 else (0, 0)
    return {
        EMB: ParamLayout(dev, (0, -1), *shard),
        PROJ: ParamLayout(dev, (-1, 0), *shard),
        FC1: ParamLayout(dev, ((1, 0), -1)),
        DP: ParamLayout(dev, (1, -1)),
        NORM: ParamLayout(dev, (-1,)),
    }


def full_tensors(optimizer: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Full weights (distinct values), fp32 Adam moments, ``global_step`` and ``learning_rate``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in SHAPES.items():
        out[name] = rng.integers(-100, 100, shape).astype(np.float32).astype(dtype)
    out[POS] = np.arange(8, dtype=np.int32)
    if optimizer:
        for prefix in ("adam_m.", "adam_v."):
            for name, (shape, _) in SHAPES.items():
                out[prefix + name] = rng.integers(-100, 100, shape).astype(np.float32)
        out["global_step"] = np.array([7], dtype=np.int32)
        out["learning_rate"] = np.array([0.5], dtype=np.float32)
    return out


def with_states(lays: Mapping[str, ParamLayout]) -> dict[str, ParamLayout]:
    """Layouts of the weights and of their Adam moments (same layout), as a training job saves them."""
    out = dict(lays)
    for prefix in ("adam_m.", "adam_v."):
        out.update({prefix + n: p for n, p in lays.items()})
    return out


def write_job(root: str, stages: list[dict[str, ParamLayout]] | None = None, optimizer: bool = True) -> dict[str, str]:
    """A full model file and a destination strategy (one file per stage in a folder); paths by role."""
    os.makedirs(root, exist_ok=True)
    full = full_tensors(optimizer)
    full_path = os.path.join(root, "full.ckpt")
    save_ckpt(full_path, full)
    stages = stages if stages is not None else [with_states(layouts()) if optimizer else layouts()]
    folder = os.path.join(root, "strategy")
    os.makedirs(folder, exist_ok=True)
    n = math.prod(next(iter(stages[0].values())).dev_matrix)
    for s, lays in enumerate(stages):
        write_strategy(os.path.join(folder, f"ckpt_strategy_rank_{s * n}.ckpt"), make_strategy(lays, stage=s))
    return {"full": full_path, "strategy": folder}


def read_dir(folder: str) -> dict[str, dict[str, np.ndarray]]:
    """file name -> {tensor: array (a copy)} of every safetensors file in ``folder``."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with read_safetensors(os.path.join(folder, name)) as idx:
                out[name] = {t: np.array(idx.array(t)) for t in idx}
    return out


def metadata(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "metadata.json"), encoding="utf-8") as fh:
        return json.load(fh)


def block(full: np.ndarray, p: ParamLayout | None, local: int) -> np.ndarray:
    """The block of ``full`` local rank ``local`` holds under ``p`` (None: all of it)."""
    if p is None:
        return full
    box = layout.rank_box(p, full.shape, local)
    return full[tuple(slice(a, b) for a, b in box)]
