"""Megatron-core names of the preset families, and maps between any two naming worlds.

A model family's weights go by three sets of names: Hugging Face's, MindFormers' (the presets of
``reshard.naming.presets``) and Megatron-core's (``GPTModel``; what Megatron-LM and Megatron-Bridge
train and save). This module holds, per family, ONE table of (Megatron-core, Hugging Face) names
and fused tensors, and builds the map between any two worlds as stages
(``reshard.naming.stages``), so every direction comes from the same tables:

* Megatron-core fuses Q, K, V into ``self_attention.linear_qkv`` grouped per query group
  (``num_query_groups`` = Hugging Face's ``num_key_value_heads`` repeats of ``[the group's Q heads,
  K, V]``) and gate and up into ``mlp.linear_fc1`` end to end (``[gate; up]``).
* Its distributed checkpoints (``torch_dist``, or any DCP saved from ``sharded_state_dict()``)
  stack a layer's tensors on a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight``
  is ``[layers, rows, hidden]``) and routed experts on a second one
  (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is ``[layers, experts, 2*ffn, hidden]``);
  a model's ``state_dict()`` names each layer (``decoder.layers.0.…``, experts
  ``mlp.experts.local_experts.E.…`` or Transformer Engine's ``mlp.experts.linear_fc1.weightE``).
  Both are read; Megatron-core names are written as ``dist_checkpointing`` saves the model
  (stacked, or per layer when its layers differ: ``stacks_layers``).
* The layer norms: the Transformer Engine layer spec fuses them into the next linear
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) and the local spec keeps them
  (``input_layernorm``, ``pre_mlp_layernorm``); ``sharded_state_dict()`` names the local ones the
  fused way too. Both are read; the fused names are written, except where Megatron-core keeps the
  norm separate (MoE layers' ``pre_mlp_layernorm``, multi-latent attention's ``input_layernorm``).

Names learnt from megatron-core 0.16.1 (tiny ``GPTModel``s, their ``state_dict()`` and
``sharded_state_dict()``) and Megatron-Bridge's published mappings; docs/megatron-names.md has the
tables. Pure data and functions over names (layer 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from reshard.errors import UsageError
from reshard.naming.expr import Size
from reshard.naming.ops import Join, ModelMap, Op, Rename, Split, Stack, Unstack
from reshard.naming.presets import FROM_HF, TO_HF, Fused, Same, get_preset, model_config

HF, MINDFORMERS, MEGATRON = "hf", "mindformers", "megatron"
WORLDS = (HF, MINDFORMERS, MEGATRON)

_FIELDS = {"L": r"\d+", "P": "weight|bias", "E": r"\d+"}
_GROUP = {"L": "L", "P": "P", "E": "expert"}

_L = "decoder.layers.{L}."
_HF_L = "model.layers.{L}."
_ATT = _L + "self_attention."
_HF_ATT = _HF_L + "self_attn."
_EXP = _L + "mlp.experts.local_experts.{E}."
_HF_EXP = _HF_L + "mlp.experts.{E}."
_Q = "num_attention_heads*head_dim"
_KV = "num_key_value_heads*head_dim"
_FFN = ("intermediate_size", "intermediate_size")
_MOE_FFN = ("moe_intermediate_size", "moe_intermediate_size")
_SHARED_FFN = ("moe_intermediate_size*n_shared_experts", "moe_intermediate_size*n_shared_experts")

Entry = Same | Fused
Read = tuple[str, str]  # (another Megatron-core spelling, the spelling it is read as): read only


def _qkv(p: str) -> Fused:
    parts = tuple(_HF_ATT + f"{x}_proj.{p}" for x in "qkv")
    return Fused(_ATT + f"linear_qkv.{p}", parts, 0, (_Q, _KV, _KV), "num_key_value_heads")


def _gate_up(megatron: str, hf: str, sizes: tuple[Size, Size]) -> Fused:
    return Fused(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), 0, sizes)


_COMMON: tuple[Entry, ...] = (
    Same("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Same("output_layer.weight", "lm_head.weight"),
    Same("decoder.final_layernorm.weight", "model.norm.weight"),
)
_GQA: tuple[Entry, ...] = (
    Same(_ATT + "linear_qkv.layer_norm_weight", _HF_L + "input_layernorm.weight"),
    _qkv("weight"),
    _qkv("bias"),
    Same(_ATT + "linear_proj.{P}", _HF_ATT + "o_proj.{P}"),
)
_QK_NORM: tuple[Entry, ...] = (
    Same(_ATT + "q_layernorm.weight", _HF_ATT + "q_norm.weight"),
    Same(_ATT + "k_layernorm.weight", _HF_ATT + "k_norm.weight"),
)
_DENSE_MLP: tuple[Entry, ...] = (
    Same(_L + "mlp.linear_fc1.layer_norm_weight", _HF_L + "post_attention_layernorm.weight"),
    _gate_up(_L + "mlp.", _HF_L + "mlp.", _FFN),
    Same(_L + "mlp.linear_fc2.{P}", _HF_L + "mlp.down_proj.{P}"),
)
_MOE_MLP: tuple[Entry, ...] = (
    Same(_L + "pre_mlp_layernorm.weight", _HF_L + "post_attention_layernorm.weight"),
    Same(_L + "mlp.router.weight", _HF_L + "mlp.gate.weight"),
    _gate_up(_EXP, _HF_EXP, _MOE_FFN),
    Same(_EXP + "linear_fc2.weight", _HF_EXP + "down_proj.weight"),
    # dense layers of a MoE model (mlp_only_layers, first_k_dense_replace)
    _gate_up(_L + "mlp.", _HF_L + "mlp.", _FFN),
    Same(_L + "mlp.linear_fc2.weight", _HF_L + "mlp.down_proj.weight"),
)
_MLA: tuple[Entry, ...] = (
    Same(_L + "input_layernorm.weight", _HF_L + "input_layernorm.weight"),
    Same(_ATT + "linear_q_down_proj.weight", _HF_ATT + "q_a_proj.weight"),
    Same(_ATT + "linear_q_up_proj.layer_norm_weight", _HF_ATT + "q_a_layernorm.weight"),
    Same(_ATT + "linear_q_up_proj.weight", _HF_ATT + "q_b_proj.weight"),
    Same(_ATT + "linear_q_proj.weight", _HF_ATT + "q_proj.weight"),  # q_lora_rank null
    Same(_ATT + "linear_kv_down_proj.weight", _HF_ATT + "kv_a_proj_with_mqa.weight"),
    Same(_ATT + "linear_kv_up_proj.layer_norm_weight", _HF_ATT + "kv_a_layernorm.weight"),
    Same(_ATT + "linear_kv_up_proj.weight", _HF_ATT + "kv_b_proj.weight"),
    Same(_ATT + "linear_proj.weight", _HF_ATT + "o_proj.weight"),
    Same(_L + "mlp.router.expert_bias", _HF_L + "mlp.gate.e_score_correction_bias"),
    _gate_up(_L + "mlp.shared_experts.", _HF_L + "mlp.shared_experts.", _SHARED_FFN),
    Same(_L + "mlp.shared_experts.linear_fc2.weight", _HF_L + "mlp.shared_experts.down_proj.weight"),
)

TABLES: dict[str, tuple[Entry, ...]] = {
    "llama": (*_COMMON, *_GQA, *_DENSE_MLP),
    "qwen2.5": (*_COMMON, *_GQA, *_DENSE_MLP),
    "qwen3": (*_COMMON, *_GQA, *_QK_NORM, *_DENSE_MLP),
    "qwen3-moe": (*_COMMON, *_GQA, *_QK_NORM, *_MOE_MLP),
    "deepseek-v3": (*_COMMON, *_MLA, *_MOE_MLP),
}

# Other spellings Megatron-core saves (local layer spec, TE's grouped experts), read as the table's.
READ_AS: tuple[Read, ...] = (
    (_L + "input_layernorm.weight", _ATT + "linear_qkv.layer_norm_weight"),
    (_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
    (_L + "mlp.linear_fc1.layer_norm_weight", _L + "pre_mlp_layernorm.weight"),
    (_ATT + "q_layernorm.weight", _ATT + "linear_q_up_proj.layer_norm_weight"),
    (_ATT + "kv_layernorm.weight", _ATT + "linear_kv_up_proj.layer_norm_weight"),
    (_L + "mlp.experts.linear_fc1.weight{E}", _EXP + "linear_fc1.weight"),
    (_L + "mlp.experts.linear_fc2.weight{E}", _EXP + "linear_fc2.weight"),
    # dist_checkpointing's singleton_local_shards: one key per expert, stacked on layers only
    (_L + "mlp.experts.experts.{E}.linear_fc1.weight", _EXP + "linear_fc1.weight"),
    (_L + "mlp.experts.experts.{E}.linear_fc2.weight", _EXP + "linear_fc2.weight"),
)


# --------------------------------------------------------------------------------------------
# templates -> regexes


def _regex(template: str) -> str:
    out = re.escape(template)
    for key, pattern in _FIELDS.items():
        out = out.replace(re.escape("{" + key + "}"), f"(?P<{_GROUP[key]}>{pattern})", 1)
    return out


def _replacement(template: str, unstack: bool = False) -> str:
    out = template
    for key in _FIELDS:
        out = out.replace("{" + key + "}", "{expert}" if unstack and key == "E" else rf"\g<{_GROUP[key]}>")
    return out


def _table_op(entry: Entry, direction: str) -> Op:
    if isinstance(entry, Same):
        src, dst = (entry.mf, entry.hf) if direction == TO_HF else (entry.hf, entry.mf)
        return Rename(_regex(src), _replacement(dst))
    if direction == TO_HF:
        return Split(_regex(entry.mf), tuple(_replacement(h) for h in entry.hf), entry.axis, entry.sizes, entry.groups)
    return Join(tuple(_regex(h) for h in entry.hf), _replacement(entry.mf), entry.axis, entry.groups)


def _reads(table: Sequence[Entry]) -> tuple[Op, ...]:
    """Renames of the other spellings whose table spelling ``table`` has (to the table's)."""
    have = {e.mf for e in table}
    return tuple(Rename(_regex(other), _replacement(mine)) for other, mine in READ_AS if mine in have)


def _megatron_names(table: Sequence[Entry]) -> list[str]:
    return [e.mf for e in table] + [other for other, mine in READ_AS if mine in {e.mf for e in table}]


def _stacked(template: str) -> tuple[str, str] | None:
    """(stacked name, per-layer name after the layer stage) of a per-layer template, None if not one."""
    if not template.startswith(_L) or "{P}" in template:
        return None
    rest = template[len(_L) :]
    if rest.startswith("mlp.experts.local_experts.{E}."):
        rest = "mlp.experts.experts." + rest[len("mlp.experts.local_experts.{E}.") :]
    elif "{E}" in rest and not rest.startswith("mlp.experts.experts.{E}."):
        return None  # Transformer Engine's per-expert state-dict names are never stacked
    return "decoder.layers." + rest, _L + rest


def _layer_stage(table: Sequence[Entry], direction: str) -> tuple[Op, ...]:
    names = _megatron_names(table) if direction == TO_HF else [e.mf for e in table]
    out: list[Op] = []
    for template in dict.fromkeys(_expand_p(names)):
        pair = _stacked(template)
        if pair is None:
            continue
        stacked, layer = pair
        if direction == TO_HF:  # the expert index of a per-expert key is group ``e`` ({expert} is the layer's)
            match = _regex(stacked).replace("(?P<expert>", "(?P<e>")
            out.append(Unstack(match, layer.replace("{L}", "{expert}").replace("{E}", r"\g<e>"), 0))
        else:
            out.append(Stack(_regex(layer).replace("(?P<L>", "(?P<expert>"), stacked, 0))
    return tuple(out)


def _expert_stage(table: Sequence[Entry], direction: str) -> tuple[Op, ...]:
    out: list[Op] = []
    for template in dict.fromkeys(_expand_p([e.mf for e in table])):
        if "{E}" not in template or not template.startswith(_EXP):
            continue
        grouped = _L + "mlp.experts.experts." + template[len(_EXP) :]
        if direction == TO_HF:
            out.append(Unstack(_regex(grouped), _replacement(template, unstack=True), 0))
        else:
            out.append(Stack(_regex(template), _replacement(grouped), 0))
    return tuple(out)


def _expand_p(templates: Sequence[str]) -> list[str]:
    return [t.replace("{P}", p) for t in templates for p in (("weight", "bias") if "{P}" in t else ("",))]


# --------------------------------------------------------------------------------------------
# worlds


def _megatron_to_hf(table: Sequence[Entry]) -> list[tuple[Op, ...]]:
    return [_layer_stage(table, TO_HF), _expert_stage(table, TO_HF), _reads(table), _ops(table, TO_HF)]


def _hf_to_megatron(table: Sequence[Entry], stacked: bool) -> list[tuple[Op, ...]]:
    layers = [_layer_stage(table, FROM_HF)] if stacked else []
    return [_ops(table, FROM_HF), _expert_stage(table, FROM_HF), *layers]


def stacks_layers(family: str, config: Mapping[str, object]) -> bool:
    """Whether Megatron-core's distributed checkpoint of this model stacks its layers.

    Megatron-core stacks them only when every layer has the same modules: a MoE model with dense
    layers (``moe_layer_freq`` a list, as Megatron-Bridge builds it for DeepSeek-V3's
    ``first_k_dense_replace``, or Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``) saves
    each layer under its index, ``decoder.layers.N.…`` (routed experts still stacked per layer).
    """
    if family == "deepseek-v3":
        return False
    sparse_step = config.get("decoder_sparse_step", 1)
    return not config.get("mlp_only_layers") and (sparse_step in (None, 1))


def _ops(table: Sequence[Entry], direction: str) -> tuple[Op, ...]:
    return tuple(_table_op(e, direction) for e in table)


def dense_layers(family: str, config: Mapping[str, object]) -> list[int]:
    """The dense layers of a MoE model, as ``transformers`` decides them (empty: none, or not known).

    DeepSeek-V3: the first ``first_k_dense_replace`` (``transformers``' default 3); Qwen3-MoE: those in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` (of ``num_hidden_layers``).
    """
    layers = config.get("num_hidden_layers")
    if family == "deepseek-v3":
        k = config.get("first_k_dense_replace", 3)
        return list(range(k if isinstance(k, int) else 0))
    if family != "qwen3-moe":
        return []
    listed = config.get("mlp_only_layers")
    only = [i for i in listed if isinstance(i, int)] if isinstance(listed, list) else []
    step = config.get("decoder_sparse_step") or 1
    step = step if isinstance(step, int) and step > 0 else 1
    if not isinstance(layers, int):
        return sorted(only) if step == 1 else []
    return [i for i in range(layers) if i in only or (i + 1) % step]


def _dense_norms(dense: Sequence[int]) -> tuple[Op, ...]:
    """A dense layer's norm under the name Transformer Engine's spec fuses it into (MoE layers keep theirs)."""
    if not dense:
        return ()
    indices = "|".join(str(i) for i in dense)
    match = rf"decoder\.layers\.(?P<L>{indices})\.pre_mlp_layernorm\.weight"
    return (Rename(match, r"decoder.layers.\g<L>.mlp.linear_fc1.layer_norm_weight"),)


def _stages(family: str, src: str, dst: str, values: Mapping[str, object]) -> list[tuple[Op, ...]]:
    table = TABLES[family]
    if src == MEGATRON:
        head = _megatron_to_hf(table)
        tail = [] if dst == HF else [get_preset(family).ops(FROM_HF)]
        return head + tail
    head = [] if src == HF else [get_preset(family).ops(TO_HF)]
    norms = _dense_norms(dense_layers(family, values))
    return [*head, *_hf_to_megatron(table, stacks_layers(family, values)), norms]


def world_map(family: str, src: str, dst: str, config: Mapping[str, object] | None = None) -> ModelMap:
    """The map of ``family``'s weights from naming world ``src`` to ``dst`` (one of them Megatron-core).

    Args:
        family: A preset family with a Megatron-core table (``TABLES``).
        src: ``"megatron"``, ``"hf"`` or ``"mindformers"``.
        dst: Another of those; ``src`` or ``dst`` is ``"megatron"`` (the presets themselves map
            MindFormers <-> Hugging Face).
        config: The model's Hugging Face ``config.json`` values (the sizes of the fused tensors).

    Returns:
        A staged ``ModelMap`` named ``"preset FAMILY (SRC -> DST names)"``. Megatron-core names are
        read stacked or per layer, and written as its distributed checkpoint holds them
        (``stacks_layers``).

    Raises:
        UsageError: An unknown family or world, the same world twice, neither world Megatron-core,
            or a size key the config lacks (named, with ``--hf-config``).

    Example:
        from reshard.naming.megatron import world_map
        m = world_map("llama", "megatron", "hf", {"num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 96})
        assert m.name == "preset llama (megatron -> hf names)"
    """
    if family not in TABLES:
        raise UsageError(f"no Megatron-core names for preset {family!r} (known: {', '.join(TABLES)})")
    for world in (src, dst):
        if world not in WORLDS:
            raise UsageError(f"unknown naming world {world!r} (one of {', '.join(WORLDS)})")
    if src == dst or MEGATRON not in (src, dst):
        raise UsageError(f"names from {src} to {dst}: one side must be megatron, the other hf or mindformers")
    values = model_config(config)
    stages = [ops for ops in _stages(family, src, dst, values) if ops]
    name = f"preset {family} ({src} -> {dst} names)"
    _check_keys(stages, values, name, config is not None)
    model: ModelMap | None = None
    for ops in reversed(stages):
        model = ModelMap(ops, values, name, model)
    assert model is not None
    return model


def _check_keys(stages: Sequence[tuple[Op, ...]], values: Mapping[str, object], name: str, given: bool) -> None:
    for ops in stages:
        for op in ops:
            sizes: list[Size | None] = [op.groups] if isinstance(op, Split | Join) else []
            if isinstance(op, Split):
                sizes += list(op.sizes)
            if isinstance(op, Unstack):
                sizes.append(op.experts)
            keys = [w for s in sizes if isinstance(s, str) for w in re.findall(r"[A-Za-z_]\w*", s)]
            missing = [k for k in keys if k not in values]
            if missing:
                where = "the --hf-config config.json lacks it" if given else "pass --hf-config config.json"
                raise UsageError(f"{name}: splitting/joining fused tensors needs {missing[0]!r} ({where})")


__all__ = ["HF", "MEGATRON", "MINDFORMERS", "READ_AS", "TABLES", "WORLDS", "dense_layers", "stacks_layers", "world_map"]
