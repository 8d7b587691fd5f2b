"""Synthetic LLaMA-like checkpoints and strategy files, made with reshard's own code.

Used by ``reshard demo``, the tests and the benchmarks, so that every example is generated on
the spot (no downloads) and shaped like real training output: token embedding shared by the first
and last pipeline stage with a different layout in each, column- and row-parallel projections,
replicated norms, Adam moments with optimizer-parallel shards, and non-strategy scalars
(``global_step``, ``learning_rate``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from reshard import dtypes
from reshard.formats.strategy import StrategyFile, make_strategy, write_strategy
from reshard.layout import ParamLayout

COLUMN = (0, -1)  # [out, in] weight split on its output rows over the model-parallel axis
ROW = (-1, 0)  # split on its input columns
REPLICATED_1D = (-1,)


@dataclass(frozen=True)
class ModelShape:
    vocab: int = 512
    hidden: int = 128
    ffn: int = 256
    layers: int = 4
    heads: int = 4  # attention heads (no weight's shape shows them; the Hugging Face config says them)

    @classmethod
    def for_bytes(cls, target: int, itemsize: int = 4, with_optimizer: bool = True) -> ModelShape:
        """A shape whose full checkpoint is roughly ``target`` bytes (4 layers, hidden scaled)."""
        copies = 3 if with_optimizer else 1
        hidden = 256
        while True:
            shape = cls(vocab=4 * hidden, hidden=hidden, ffn=4 * hidden, layers=4)
            if shape.param_count() * itemsize * copies >= target:
                return shape
            hidden += 128

    def hf_config(self) -> dict[str, object]:
        """This model as a Hugging Face ``LlamaForCausalLM`` config (the ``llama`` preset's names).

        The demo writes it as ``config.json`` so that a Hugging Face export of its model
        (``--hf --preset llama --hf-config DIR/config.json``) loads in ``transformers`` as it is.
        """
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def param_count(self) -> int:
        return sum(int(np.prod(s)) for s, _, _ in self.params().values())

    def params(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
        """name -> (full shape, tensor map, "first"|"last"|layer stage marker)."""
        h, f = self.hidden, self.ffn
        out: dict[str, tuple[tuple[int, ...], tuple[int, ...], str]] = {
            "model.tok_embeddings.embedding_weight": ((self.vocab, h), COLUMN, "first"),
        }
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "attention_norm.weight"] = ((h,), REPLICATED_1D, str(i))
            for w in ("wq", "wk", "wv"):
                out[p + f"attention.{w}.weight"] = ((h, h), COLUMN, str(i))
            out[p + "attention.wo.weight"] = ((h, h), ROW, str(i))
            out[p + "ffn_norm.weight"] = ((h,), REPLICATED_1D, str(i))
            out[p + "feed_forward.w1.weight"] = ((f, h), COLUMN, str(i))
            out[p + "feed_forward.w3.weight"] = ((f, h), COLUMN, str(i))
            out[p + "feed_forward.w2.weight"] = ((h, f), ROW, str(i))
        out["model.norm_out.weight"] = ((h,), REPLICATED_1D, "last")
        out["lm_head.weight"] = ((self.vocab, h), COLUMN, "last")
        return out


def full_model(
    shape: ModelShape, dtype: str = "float32", optimizer: bool = True, seed: int = 0
) -> dict[str, np.ndarray]:
    """Full (unsharded) weights, Adam moments and scalars, in training-checkpoint order."""
    rng = np.random.default_rng(seed)
    np_dtype = dtypes.BFLOAT16.numpy if dtype == "bfloat16" else np.dtype(dtype)  # ml_dtypes for bf16 only
    weights: dict[str, np.ndarray] = {}
    for name, (full, _, _) in shape.params().items():
        weights[name] = rng.standard_normal(full, dtype=np.float32).astype(np_dtype)
    out = dict(weights)
    if optimizer:
        for prefix in ("adam_m.", "adam_v."):
            for name, (full, _, _) in shape.params().items():
                out[prefix + name] = rng.standard_normal(full, dtype=np.float32).astype(np.float32)
    out["global_step"] = np.array([1000], dtype=np.int32)
    out["learning_rate"] = np.array(3e-4, dtype=np.float32)
    return out


def _stage_of(marker: str, layers: int, stages: int) -> list[int]:
    if marker == "first":
        return [0, stages - 1] if stages > 1 else [0]  # tied embedding lives in both end stages
    if marker == "last":
        return [stages - 1]
    return [int(marker) * stages // layers]


def stage_strategies(
    shape: ModelShape, dp: int, mp: int, pp: int, opt_shard: bool, optimizer: bool = True
) -> list[StrategyFile]:
    """One strategy per pipeline stage for a dp x mp device matrix per stage.

    The shared embedding is split by rows (vocab) in stage 0 and by columns in the last stage.
    With ``opt_shard`` (needs dp > 1) every 2-D parameter and its Adam moments are saved
    optimizer-sharded over the data-parallel axis (size dp, step mp: docs/formats.md §3.3 simple path).
    """
    dev = (dp, mp)
    per_stage: list[dict[str, ParamLayout]] = [{} for _ in range(pp)]
    for name, (full, tmap, marker) in shape.params().items():
        for stage in _stage_of(marker, shape.layers, pp):
            this_map = ROW if (marker == "first" and stage == pp - 1 and pp > 1) else tmap
            sharded = opt_shard and dp > 1 and len(full) == 2
            layout = ParamLayout(dev, this_map, mp if sharded else 0, dp if sharded else 0)
            per_stage[stage][name] = layout
            if optimizer:
                per_stage[stage]["adam_m." + name] = layout
                per_stage[stage]["adam_v." + name] = layout
    return [make_strategy(layouts, stage=s) for s, layouts in enumerate(per_stage)]


def write_stage_strategies(folder: str, strategies: list[StrategyFile], devices_per_stage: int) -> list[str]:
    """Write ``ckpt_strategy_rank_<first rank of stage>.ckpt`` files as a training job leaves them."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for stage, sf in enumerate(strategies):
        path = os.path.join(folder, f"ckpt_strategy_rank_{stage * devices_per_stage}.ckpt")
        write_strategy(path, sf)
        paths.append(path)
    return paths


__all__ = ["COLUMN", "REPLICATED_1D", "ROW", "ModelShape", "full_model", "stage_strategies", "write_stage_strategies"]
