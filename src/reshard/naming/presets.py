"""Model presets: the MindFormers <-> Hugging Face name maps of whole model families, as plain data.

MindFormers converts its checkpoints to and from Hugging Face with a per-model script that needs
both torch and MindSpore. A preset says the same thing as data in the surgery vocabulary of
``reshard.naming.ops`` (``Rename``, ``Split``, ``Join``), so any writing command can stream it.
What each family needs — and where in MindFormers 2.1.0 it was read — is in docs/presets.md:

* ``llama`` — LLaMA 2/3 under MindFormers' legacy names (``model.tok_embeddings.embedding_weight``,
  ``attention.wq``, ``feed_forward.w1``, ``attention_norm``, ``norm_out``; pure renames).
* ``llama-qkv-concat`` — the same with ``attention.w_qkv`` (Q, K, V grouped per key-value head)
  and ``feed_forward.w_gate_hidden`` (gate and up rows interleaved).
* ``qwen2.5`` — Qwen2/2.5 under MindFormers' Megatron-style names (``decoder.layers.N.
  self_attention.linear_q``, ``mlp.gating``, ...; pure renames, biases included).
* ``qwen3`` — Qwen3 as MindFormers' training model holds it: fused ``linear_qkv`` (grouped per
  key-value head) and ``linear_fc1`` (gate and up rows interleaved), ``q_layernorm``/``k_layernorm``.
* ``qwen3-moe`` / ``deepseek-v3`` — plus the routed experts as MindFormers' grouped ``weight1``
  (each expert's gate and up, transposed, side by side) and ``weight2`` (down, transposed), the
  router, shared experts and (DeepSeek-V3) multi-head latent attention's projections.

Each family is ONE table of (MindFormers, Hugging Face) name pairs and fused tensors; both
directions are made from it, so they cannot drift apart. Every name may carry an optimizer prefix
(``adam_m.``, ``adam_v.``, ``accu_grads.``): the optimizer state follows its weight, and a round
trip is byte-identical. Sizes are expressions over the Hugging Face ``config.json`` keys
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``); a preset
that only renames needs no config at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from reshard.errors import UsageError
from reshard.naming.expr import Size
from reshard.naming.ops import Join, ModelMap, Op, Rename, Split, Stack, Unstack

# Optimizer-state prefixes a weight's name may carry; the state is mapped with its weight.
OPTIMIZER_PREFIXES = ("adam_m.", "adam_v.", "accu_grads.")
_PREFIX = "(?P<prefix>(?:" + "|".join(re.escape(p) for p in OPTIMIZER_PREFIXES) + ")?)"
# Placeholders of the name templates below, and what each matches.
_FIELDS = {"L": r"\d+", "P": "weight|bias"}
_EXPERT = "(?P<expert>\\d+)"  # {E} in a pattern; Stack and Unstack want this group name

TO_HF = "to-hf"
FROM_HF = "from-hf"


@dataclass(frozen=True)
class Same:
    """One tensor with a MindFormers and a Hugging Face name (templates with ``{L}`` layer, ``{P}`` weight/bias)."""

    mf: str
    hf: str


@dataclass(frozen=True)
class Fused:
    """One MindFormers tensor that is several Hugging Face tensors joined along ``axis``.

    ``sizes[p]`` is Hugging Face part ``p``'s length along ``axis``; with ``groups`` the fused axis
    is ``groups`` repeats of ``[part0, part1, ...]`` (see ``reshard.naming.ops.Split``).
    """

    mf: str
    hf: tuple[str, ...]
    axis: int
    sizes: tuple[Size, ...]
    groups: Size | None = None


@dataclass(frozen=True)
class Experts:
    """A layer's routed experts: one MindFormers tensor that is every expert's Hugging Face parts.

    MindFormers' grouped experts fold the experts on axis 0, each expert's parts transposed and
    joined on axis 1 (``weight1`` = gate.T | up.T, ``weight2`` = down.T). ``hf`` are per-expert
    templates with ``{E}`` (the expert index); ``experts`` is the config key of their number.
    """

    mf: str
    hf: tuple[str, ...]
    experts: Size


Entry = Same | Fused | Experts


@dataclass(frozen=True)
class Preset:
    """A model family's MindFormers <-> Hugging Face table."""

    name: str
    description: str
    entries: tuple[Entry, ...]

    def ops(self, direction: str) -> tuple[Op, ...]:
        """The operations of ``direction`` (``TO_HF``: MindFormers -> Hugging Face, ``FROM_HF``: back)."""
        if direction not in (TO_HF, FROM_HF):
            raise UsageError(f"preset direction must be {TO_HF!r} or {FROM_HF!r}, not {direction!r}")
        return tuple(_op(e, direction) for e in self.entries)


def _regex(template: str) -> str:
    out = _PREFIX + re.escape(template)
    for key, pattern in _FIELDS.items():
        out = out.replace(re.escape("{" + key + "}"), f"(?P<{key}>{pattern})")
    return out.replace(re.escape("{E}"), _EXPERT)


def _replacement(template: str) -> str:
    out = r"\g<prefix>" + template
    for key in _FIELDS:
        out = out.replace("{" + key + "}", rf"\g<{key}>")
    return out.replace("{E}", "{expert}")


def _op(entry: Entry, direction: str) -> Op:
    if isinstance(entry, Same):
        src, dst = (entry.mf, entry.hf) if direction == TO_HF else (entry.hf, entry.mf)
        return Rename(_regex(src), _replacement(dst))
    if isinstance(entry, Experts):
        first, *rest = entry.hf
        if direction == TO_HF:
            outputs = tuple(_replacement(h) for h in rest)
            return Unstack(_regex(entry.mf), _replacement(first), 0, (1, 0), entry.experts, outputs, part_axis=0)
        parts = tuple(_regex(h) for h in rest)
        return Stack(_regex(first), _replacement(entry.mf), 0, (1, 0), fold=True, parts=parts, part_axis=1)
    if direction == TO_HF:
        outputs = tuple(_replacement(h) for h in entry.hf)
        return Split(_regex(entry.mf), outputs, entry.axis, entry.sizes, entry.groups)
    return Join(tuple(_regex(h) for h in entry.hf), _replacement(entry.mf), entry.axis, entry.groups)


# --------------------------------------------------------------------------------------------
# the families (docs/presets.md says where in MindFormers 2.1.0 each table was read)

_HF_LAYER = "model.layers.{L}."
_Q = "num_attention_heads*head_dim"
_KV = "num_key_value_heads*head_dim"

_LLAMA_COMMON = (
    Same("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    Same("model.layers.{L}.attention.wo.{P}", _HF_LAYER + "self_attn.o_proj.{P}"),
    Same("model.layers.{L}.feed_forward.w2.{P}", _HF_LAYER + "mlp.down_proj.{P}"),
    Same("model.layers.{L}.attention_norm.weight", _HF_LAYER + "input_layernorm.weight"),
    Same("model.layers.{L}.ffn_norm.weight", _HF_LAYER + "post_attention_layernorm.weight"),
    Same("model.norm_out.weight", "model.norm.weight"),
    Same("lm_head.weight", "lm_head.weight"),
)

LLAMA = Preset(
    "llama",
    "LLaMA 2/3, MindFormers legacy names (attention.wq, feed_forward.w1, ...): renames only",
    (
        *_LLAMA_COMMON,
        Same("model.layers.{L}.attention.wq.{P}", _HF_LAYER + "self_attn.q_proj.{P}"),
        Same("model.layers.{L}.attention.wk.{P}", _HF_LAYER + "self_attn.k_proj.{P}"),
        Same("model.layers.{L}.attention.wv.{P}", _HF_LAYER + "self_attn.v_proj.{P}"),
        Same("model.layers.{L}.feed_forward.w1.{P}", _HF_LAYER + "mlp.gate_proj.{P}"),
        Same("model.layers.{L}.feed_forward.w3.{P}", _HF_LAYER + "mlp.up_proj.{P}"),
    ),
)

_QKV_PARTS = tuple(_HF_LAYER + f"self_attn.{x}_proj.weight" for x in "qkv")
_QKV_BIAS_PARTS = tuple(_HF_LAYER + f"self_attn.{x}_proj.bias" for x in "qkv")
_GATE_UP = (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight")

LLAMA_QKV_CONCAT = Preset(
    "llama-qkv-concat",
    "LLaMA 2/3, MindFormers legacy names with qkv_concat: w_qkv (grouped per kv head), w_gate_hidden (interleaved)",
    (
        *_LLAMA_COMMON,
        Fused("model.layers.{L}.attention.w_qkv.weight", _QKV_PARTS, 0, (_Q, _KV, _KV), "num_key_value_heads"),
        # MindFormers' legacy converter joins the biases end to end, not per group.
        Fused("model.layers.{L}.attention.w_qkv.bias", _QKV_BIAS_PARTS, 0, (_Q, _KV, _KV)),
        Fused(
            "model.layers.{L}.feed_forward.w_gate_hidden.weight",
            _GATE_UP,
            0,
            ("intermediate_size", "intermediate_size"),
            "intermediate_size",
        ),
    ),
)

_MCORE_LAYER = "decoder.layers.{L}."
_MCORE_COMMON = (
    Same("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Same("output_layer.weight", "lm_head.weight"),
    Same("decoder.final_layernorm.weight", "model.norm.weight"),
    Same(_MCORE_LAYER + "self_attention.linear_proj.{P}", _HF_LAYER + "self_attn.o_proj.{P}"),
    Same(_MCORE_LAYER + "input_layernorm.weight", _HF_LAYER + "input_layernorm.weight"),
    Same(_MCORE_LAYER + "pre_mlp_layernorm.weight", _HF_LAYER + "post_attention_layernorm.weight"),
    Same(_MCORE_LAYER + "mlp.linear_fc2.{P}", _HF_LAYER + "mlp.down_proj.{P}"),
)

QWEN2_5 = Preset(
    "qwen2.5",
    "Qwen2/Qwen2.5, MindFormers names (decoder.layers.N.self_attention.linear_q, mlp.gating, ...): renames only",
    (
        *_MCORE_COMMON,
        Same(_MCORE_LAYER + "self_attention.linear_q.{P}", _HF_LAYER + "self_attn.q_proj.{P}"),
        Same(_MCORE_LAYER + "self_attention.linear_k.{P}", _HF_LAYER + "self_attn.k_proj.{P}"),
        Same(_MCORE_LAYER + "self_attention.linear_v.{P}", _HF_LAYER + "self_attn.v_proj.{P}"),
        Same(_MCORE_LAYER + "mlp.gating.{P}", _HF_LAYER + "mlp.gate_proj.{P}"),
        Same(_MCORE_LAYER + "mlp.hidden.{P}", _HF_LAYER + "mlp.up_proj.{P}"),
    ),
)

QWEN3 = Preset(
    "qwen3",
    "Qwen3, MindFormers training names: linear_qkv (grouped per kv head), linear_fc1 (gate/up interleaved)",
    (
        *_MCORE_COMMON,
        Fused(_MCORE_LAYER + "self_attention.linear_qkv.weight", _QKV_PARTS, 0, (_Q, _KV, _KV), "num_key_value_heads"),
        Fused(
            _MCORE_LAYER + "self_attention.linear_qkv.bias", _QKV_BIAS_PARTS, 0, (_Q, _KV, _KV), "num_key_value_heads"
        ),
        Same(_MCORE_LAYER + "self_attention.q_layernorm.weight", _HF_LAYER + "self_attn.q_norm.weight"),
        Same(_MCORE_LAYER + "self_attention.k_layernorm.weight", _HF_LAYER + "self_attn.k_norm.weight"),
        Fused(
            _MCORE_LAYER + "mlp.linear_fc1.weight",
            _GATE_UP,
            0,
            ("intermediate_size", "intermediate_size"),
            "intermediate_size",
        ),
    ),
)

_HF_EXPERT = _HF_LAYER + "mlp.experts.{E}."

QWEN3_MOE = Preset(
    "qwen3-moe",
    "Qwen3-MoE, MindFormers training names: linear_qkv (grouped per kv head), grouped experts weight1/weight2, router",
    (
        *_MCORE_COMMON,
        Fused(_MCORE_LAYER + "self_attention.linear_qkv.weight", _QKV_PARTS, 0, (_Q, _KV, _KV), "num_key_value_heads"),
        Same(_MCORE_LAYER + "self_attention.q_layernorm.weight", _HF_LAYER + "self_attn.q_norm.weight"),
        Same(_MCORE_LAYER + "self_attention.k_layernorm.weight", _HF_LAYER + "self_attn.k_norm.weight"),
        Same(_MCORE_LAYER + "mlp.router.weight", _HF_LAYER + "mlp.gate.weight"),
        Experts(
            _MCORE_LAYER + "mlp.experts.weight1",
            (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
            "num_experts",
        ),
        Experts(_MCORE_LAYER + "mlp.experts.weight2", (_HF_EXPERT + "down_proj.weight",), "num_experts"),
        # dense layers (mlp_only_layers): gate and up end to end, as the MoE model's loader joins them
        Fused(_MCORE_LAYER + "mlp.linear_fc1.weight", _GATE_UP, 0, ("intermediate_size", "intermediate_size")),
    ),
)

_MLA = _MCORE_LAYER + "self_attention."
_HF_MLA = _HF_LAYER + "self_attn."

DEEPSEEK_V3 = Preset(
    "deepseek-v3",
    "DeepSeek-V3, MindFormers names: MLA projections, dense and shared-expert MLPs, router, grouped experts",
    (
        Same("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Same("output_layer.weight", "lm_head.weight"),
        Same("decoder.final_layernorm.weight", "model.norm.weight"),
        Same(_MCORE_LAYER + "input_layernorm.weight", _HF_LAYER + "input_layernorm.weight"),
        Same(_MCORE_LAYER + "pre_mlp_layernorm.weight", _HF_LAYER + "post_attention_layernorm.weight"),
        Same(_MLA + "linear_q_down_proj.{P}", _HF_MLA + "q_a_proj.{P}"),
        Same(_MLA + "q_layernorm.weight", _HF_MLA + "q_a_layernorm.weight"),
        Same(_MLA + "linear_q_up_proj.{P}", _HF_MLA + "q_b_proj.{P}"),
        Same(_MLA + "linear_q_proj.{P}", _HF_MLA + "q_proj.{P}"),  # q_lora_rank null: no down/up
        Same(_MLA + "linear_kv_down_proj.{P}", _HF_MLA + "kv_a_proj_with_mqa.{P}"),
        Same(_MLA + "kv_layernorm.weight", _HF_MLA + "kv_a_layernorm.weight"),
        Same(_MLA + "linear_kv_up_proj.{P}", _HF_MLA + "kv_b_proj.{P}"),
        Same(_MLA + "linear_proj.{P}", _HF_MLA + "o_proj.{P}"),
        Same(_MCORE_LAYER + "mlp.router.weight", _HF_LAYER + "mlp.gate.weight"),
        Same(_MCORE_LAYER + "mlp.router.expert_bias", _HF_LAYER + "mlp.gate.e_score_correction_bias"),
        Same(_MCORE_LAYER + "mlp.shared_experts.gating.weight", _HF_LAYER + "mlp.shared_experts.gate_proj.weight"),
        Same(_MCORE_LAYER + "mlp.shared_experts.hidden.weight", _HF_LAYER + "mlp.shared_experts.up_proj.weight"),
        Same(_MCORE_LAYER + "mlp.shared_experts.linear_fc2.weight", _HF_LAYER + "mlp.shared_experts.down_proj.weight"),
        Same(_MCORE_LAYER + "mlp.gating.weight", _HF_LAYER + "mlp.gate_proj.weight"),  # dense layers
        Same(_MCORE_LAYER + "mlp.hidden.weight", _HF_LAYER + "mlp.up_proj.weight"),
        Same(_MCORE_LAYER + "mlp.linear_fc2.weight", _HF_LAYER + "mlp.down_proj.weight"),
        Experts(
            _MCORE_LAYER + "mlp.experts.weight1",
            (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
            "n_routed_experts",
        ),
        Experts(_MCORE_LAYER + "mlp.experts.weight2", (_HF_EXPERT + "down_proj.weight",), "n_routed_experts"),
    ),
)

PRESETS: Mapping[str, Preset] = {p.name: p for p in (LLAMA, LLAMA_QKV_CONCAT, QWEN2_5, QWEN3, QWEN3_MOE, DEEPSEEK_V3)}


# --------------------------------------------------------------------------------------------
# choosing and resolving a preset


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        UsageError: No preset has that name (the known ones are listed).
    """
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config(config: Mapping[str, object] | None) -> dict[str, object]:
    """A ``config.json``'s values with the defaults Hugging Face itself applies when a key is absent.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads`` to
    ``num_attention_heads`` (as ``transformers``' Llama, Qwen2 and Qwen3 configs do), and
    ``num_experts`` is ``num_local_experts`` where only that is given (``transformers`` 5 saves
    Qwen3-MoE's expert count under that name). Nothing else is invented: a key a size needs and the
    config lacks is an error when the size is used.
    """
    values = dict(config or {})
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if values.get("num_key_value_heads") is None and isinstance(heads, int):
        values["num_key_value_heads"] = heads
    if values.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int) and heads:
        values["head_dim"] = hidden // heads
    if values.get("num_experts") is None and values.get("num_local_experts") is not None:
        values["num_experts"] = values["num_local_experts"]  # transformers 5 writes Qwen3-MoE's under this name
    return values


def direction_for(preset: Preset, names: Iterable[str]) -> str:
    """Which way ``names`` go: ``TO_HF`` when more of them match the MindFormers side, else ``FROM_HF``."""
    listed = list(names)
    counts = {d: _matched(preset.ops(d), listed) for d in (TO_HF, FROM_HF)}
    return TO_HF if counts[TO_HF] >= counts[FROM_HF] else FROM_HF


def preset_map(
    name: str,
    names: Iterable[str] | None = None,
    config: Mapping[str, object] | None = None,
    direction: str | None = None,
) -> ModelMap:
    """The ``ModelMap`` of preset ``name``.

    Args:
        name: A preset name (``PRESETS``).
        names: The input tensor names, when known: they pick the direction when ``direction`` is
            None and say which fused tensors are present (so which config keys are needed).
            None: the map holds both directions (a MindFormers name goes to Hugging Face, a
            Hugging Face name to MindFormers) and every key its surgery uses must be in ``config``.
        config: The model's Hugging Face ``config.json`` values (``--hf-config``), or None.
        direction: ``TO_HF`` (MindFormers -> Hugging Face), ``FROM_HF``, or None (see ``names``).

    Returns:
        A ``ModelMap`` named ``"preset NAME"`` with the operations and config values.

    Raises:
        UsageError: An unknown preset, or surgery whose sizes use a key the config does not give
            (the key and ``--hf-config`` are named).

    Example:
        from reshard.naming.presets import TO_HF, preset_map
        m = preset_map("llama", ["model.norm_out.weight"], direction=TO_HF)
        assert m.name == "preset llama"
    """
    preset = get_preset(name)
    listed = None if names is None else list(names)
    if direction is not None:
        ops = preset.ops(direction)
    elif listed is not None:
        ops = preset.ops(direction_for(preset, listed))
    else:
        ops = preset.ops(TO_HF) + preset.ops(FROM_HF)
    values = model_config(config)
    for op in ops:
        if isinstance(op, Rename) or (listed is not None and not _matched((op,), listed)):
            continue
        missing = [k for k in _keys(op) if k not in values]
        if missing:
            given = "the --hf-config config.json lacks it" if config is not None else "pass --hf-config config.json"
            raise UsageError(
                f"preset {name}: splitting/joining fused tensors needs {missing[0]!r} from the model's config ({given})"
            )
    return ModelMap(ops, values, f"preset {name}")


def _patterns(op: Op) -> tuple[str, ...]:
    if isinstance(op, Join):
        return op.inputs
    return (op.match, *op.parts) if isinstance(op, Stack) else (op.match,)


def _matched(ops: Iterable[Op], names: list[str]) -> int:
    regexes = [re.compile(p) for op in ops for p in _patterns(op)]
    return sum(1 for n in names if any(r.fullmatch(n) for r in regexes))


def _keys(op: Op) -> list[str]:
    # a join's part lengths come from its inputs: only its groups use the config
    sizes: list[Size | None] = [op.groups] if isinstance(op, Split | Join) else []
    if isinstance(op, Unstack):
        sizes.append(op.experts)
    if isinstance(op, Split):
        sizes += list(op.sizes)
    return [w for s in sizes if isinstance(s, str) for w in re.findall(r"[A-Za-z_]\w*", s)]


__all__ = [
    "DEEPSEEK_V3",
    "FROM_HF",
    "LLAMA",
    "LLAMA_QKV_CONCAT",
    "OPTIMIZER_PREFIXES",
    "PRESETS",
    "QWEN2_5",
    "QWEN3",
    "QWEN3_MOE",
    "TO_HF",
    "Experts",
    "Fused",
    "Preset",
    "Same",
    "direction_for",
    "get_preset",
    "model_config",
    "preset_map",
]
