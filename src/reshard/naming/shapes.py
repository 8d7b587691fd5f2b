"""A model config agrees with the tensors' shapes: what ``config.json`` says each full tensor is.

A run given a model config (``--hf-config``, the config of a preset's map, the ``config.json`` of
a Hugging Face folder it reads) uses it for sizes (a preset's splits) or copies it beside its
output; a config of another model size passed all of that and gave shards ``transformers``
refuses, or splits at the wrong rows. The full tensors of the families the presets know have
shapes the config determines, so they are compared before anything is written:

* embeddings and ``lm_head`` ``[vocab_size, hidden_size]``, norms ``[hidden_size]``;
* attention ``q/k/v/o_proj`` from ``num_attention_heads``, ``num_key_value_heads`` and
  ``head_dim`` (not for multi-head latent attention, whose projections have other sizes), and
  Qwen3's ``q_norm``/``k_norm`` ``[head_dim]``;
* the MLP's ``gate/up/down_proj`` from ``intermediate_size``; routed experts' from
  ``moe_intermediate_size``, the router ``[num_experts, hidden_size]``, DeepSeek's shared experts
  from ``moe_intermediate_size * n_shared_experts``;
* a layer index is below ``num_hidden_layers`` (plus DeepSeek's ``num_nextn_predict_layers``).

Names are Hugging Face's (a preset's output, a Hugging Face source); MindFormers names a preset
renames (``model.layers.0.attention.wq.weight``, ``decoder.layers.0.mlp.linear_fc2.weight``) are
read as the Hugging Face name they rename to, and optimizer states (``adam_m.``) as their weight.
A size whose keys the config lacks is not compared; other names are not compared. Pure: names,
shapes and config values in, a ``UsageError`` out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from reshard.errors import UsageError
from reshard.naming.expr import Size, evaluate
from reshard.naming.ops import Rename
from reshard.naming.presets import OPTIMIZER_PREFIXES, PRESETS, TO_HF, model_config
from reshard.text import indefinite

_LAYER = r"model\.layers\.(?P<layer>\d+)\."
_Q = "num_attention_heads*head_dim"
_KV = "num_key_value_heads*head_dim"
_SHARED = "moe_intermediate_size*n_shared_experts"


@dataclass(frozen=True)
class _Rule:
    """Tensors matching ``pattern`` have ``shape`` (sizes over config keys); ``mla``: also with MLA."""

    pattern: re.Pattern[str]
    shape: tuple[Size, ...]
    mla: bool = True


def _rule(pattern: str, *shape: Size, mla: bool = True) -> _Rule:
    return _Rule(re.compile(pattern.replace("{L}", _LAYER)), shape, mla)


RULES: tuple[_Rule, ...] = (
    _rule(r"model\.embed_tokens\.weight", "vocab_size", "hidden_size"),
    _rule(r"lm_head\.weight", "vocab_size", "hidden_size"),
    _rule(r"model\.norm\.weight", "hidden_size"),
    _rule(r"{L}(input|post_attention)_layernorm\.weight", "hidden_size"),
    _rule(r"{L}self_attn\.q_proj\.weight", _Q, "hidden_size", mla=False),
    _rule(r"{L}self_attn\.[kv]_proj\.weight", _KV, "hidden_size", mla=False),
    _rule(r"{L}self_attn\.o_proj\.weight", "hidden_size", _Q, mla=False),
    _rule(r"{L}self_attn\.q_proj\.bias", _Q, mla=False),
    _rule(r"{L}self_attn\.[kv]_proj\.bias", _KV, mla=False),
    _rule(r"{L}self_attn\.[qk]_norm\.weight", "head_dim", mla=False),
    _rule(r"{L}mlp\.(gate|up)_proj\.weight", "intermediate_size", "hidden_size"),
    _rule(r"{L}mlp\.down_proj\.weight", "hidden_size", "intermediate_size"),
    _rule(r"{L}mlp\.experts\.\d+\.(gate|up)_proj\.weight", "moe_intermediate_size", "hidden_size"),
    _rule(r"{L}mlp\.experts\.\d+\.down_proj\.weight", "hidden_size", "moe_intermediate_size"),
    _rule(r"{L}mlp\.gate\.weight", "num_experts", "hidden_size"),
    _rule(r"{L}mlp\.shared_experts\.(gate|up)_proj\.weight", _SHARED, "hidden_size"),
    _rule(r"{L}mlp\.shared_experts\.down_proj\.weight", "hidden_size", _SHARED),
)


def config_values(config: Mapping[str, object]) -> dict[str, object]:
    """``config`` with Hugging Face's defaults (``presets.model_config``) and DeepSeek's expert count
    (``n_routed_experts``) as ``num_experts``."""
    values = model_config(config)
    if values.get("num_experts") is None and values.get("n_routed_experts") is not None:
        values["num_experts"] = values["n_routed_experts"]
    return values


def check_config_shapes(
    tensors: Iterable[tuple[str, Sequence[int]]], config: Mapping[str, object], where: str | None = None
) -> int:
    """Refuse full tensors whose shapes the model ``config`` contradicts; the number compared.

    Args:
        tensors: (name, full shape) pairs, e.g. a full model's or a full output's tensors.
        config: The model config's values (``load_config``; Hugging Face defaults are applied).
        where: The config's path, for the message (None: given in memory).

    Raises:
        UsageError: A tensor's shape, or a layer index, disagrees with the config: the tensor, its
            shape and the config key and value are named.

    Example:
        from reshard.naming.shapes import check_config_shapes
        config = {"vocab_size": 512, "hidden_size": 128}
        assert check_config_shapes([("model.embed_tokens.weight", (512, 128))], config) == 1
    """
    values = config_values(config)
    mla = values.get("kv_lora_rank") is not None
    layers = _layer_count(values)
    compared = 0
    for name, shape in tensors:
        hf = _hf_name(name)
        for rule in RULES:
            match = rule.pattern.fullmatch(hf)
            if match is None:
                continue
            if "layer" in match.groupdict() and layers is not None and int(match["layer"]) >= layers:
                raise UsageError(
                    f"{name} is layer {match['layer']}, but the model config's num_hidden_layers is "
                    f"{values['num_hidden_layers']}: is it this model's config?",
                    where,
                )
            if mla and not rule.mla:
                break
            compared += _compare(name, tuple(shape), rule.shape, values, where)
            break
    return compared


def _layer_count(values: Mapping[str, object]) -> int | None:
    layers, extra = values.get("num_hidden_layers"), values.get("num_nextn_predict_layers") or 0
    if isinstance(layers, bool) or not isinstance(layers, int) or not isinstance(extra, int):
        return None
    return layers + extra


def _compare(
    name: str, shape: tuple[int, ...], sizes: tuple[Size, ...], values: Mapping[str, object], where: str | None
) -> int:
    expected = [_size(s, values) for s in sizes]
    if len(shape) != len(expected):
        known = [e for e in expected if e is not None]
        raise UsageError(
            f"{name} is {list(shape)}, but the model config describes {indefinite(len(expected))}-D tensor "
            f"({_says(sizes, known, values)}): is it this model's config?",
            where,
        )
    for dim, (got, want, size) in enumerate(zip(shape, expected, sizes, strict=True)):
        if want is not None and got != want:
            raise UsageError(
                f"{name} is {list(shape)}, but the model config's {_says((size,), [want], values)} "
                f"gives dim {dim} {want}: is it this model's config?",
                where,
            )
    return 1 if any(e is not None for e in expected) else 0


def _size(size: Size, values: Mapping[str, object]) -> int | None:
    try:
        return evaluate(size, values)
    except UsageError:  # a key the config lacks (or not an integer): nothing to compare
        return None


def _says(sizes: Sequence[Size], wants: Sequence[int], values: Mapping[str, object]) -> str:
    """``num_attention_heads*head_dim = 256 (num_attention_heads 8, head_dim 32)`` for a message."""
    parts = []
    for size, want in zip(sizes, wants, strict=False):
        keys = re.findall(r"[A-Za-z_]\w*", str(size))
        text = f"{size} = {want}"
        if len(keys) > 1 or (keys and keys[0] != size):
            text += " (" + ", ".join(f"{k} {values.get(k)}" for k in keys) + ")"
        parts.append(text)
    return ", ".join(parts)


def _hf_name(name: str) -> str:
    """``name`` as the Hugging Face name the rules are written for (see the module docstring)."""
    for prefix in OPTIMIZER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    for pattern, replacement in _renames():
        match = pattern.fullmatch(name)
        if match is not None:
            return match.expand(replacement)
    return name


@functools.cache
def _renames() -> tuple[tuple[re.Pattern[str], str], ...]:
    """Every preset's MindFormers -> Hugging Face renames (one-to-one names only)."""
    out = []
    for preset in PRESETS.values():
        for op in preset.ops(TO_HF):
            if isinstance(op, Rename):
                out.append((re.compile(op.match), op.replace))
    return tuple(out)


__all__ = ["RULES", "check_config_shapes", "config_values"]
