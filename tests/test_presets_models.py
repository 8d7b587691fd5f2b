"""Presets on tiny random models of each family made with ``transformers`` (in the hf venv).

For each preset: a tiny model saved with ``save_pretrained`` is mapped Hugging Face -> MindFormers
with the preset's operations (``reshard.naming.apply``, whose pieces are copied here with numpy, the
way the executors copy them), the MindFormers tensors are compared with what MindFormers 2.1.0's
own conversion functions make of the same weights (in the oracle venv), mapped back, and
``from_pretrained`` on the result must give exactly the original logits. MindFormers names ->
Hugging Face -> MindFormers names must round-trip byte-identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reshard.errors import UsageError
from reshard.naming import TensorInfo, apply, check_family
from reshard.naming.presets import FROM_HF, PRESETS, TO_HF, direction_for, preset_map
from tests.hf import load_models, make_models

MOE = {
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "head_dim": 16,
}
DEEPSEEK = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
# preset -> (transformers family, config overrides)
FAMILIES = {
    "llama": ("llama", {}),
    "llama-qkv-concat": ("llama", {}),
    "qwen2.5": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),  # head_dim * heads != hidden: the config's head_dim is used
    "qwen3-moe": ("qwen3_moe", MOE),
    "deepseek-v3": ("deepseek_v3", DEEPSEEK),
}


def materialize(model_map, tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], object]:
    """The outputs of ``model_map`` on ``tensors``, each filled piece by piece (boxes of views, permuted)."""
    catalogue = {n: TensorInfo(tuple(a.shape), str(a.dtype)) for n, a in tensors.items()}
    applied = apply(model_map, catalogue)
    out: dict[str, np.ndarray] = {}
    for d in applied.outputs:
        first = tensors[d.pieces[0].source]
        arr = np.zeros(d.shape, dtype=first.dtype)
        filled = 0
        for p in d.pieces:
            src = tensors[p.source]
            src = src.reshape(p.view) if p.view is not None else src
            box = tuple(slice(s, s + n) for s, n in zip(p.src_start, p.src_lengths, strict=True))
            dst = tuple(slice(s, s + n) for s, n in zip(p.dst_start, p.lengths, strict=True))
            arr[dst] = src[box] if p.perm is None else src[box].transpose(p.perm)
            filled += int(np.prod(p.lengths))
        assert filled == arr.size, d.name
        out[d.name] = arr
    return out, applied.report


@pytest.fixture(scope="module")
def tiny(hf, tmp_path_factory):
    """preset -> folder of a saved tiny random model (config.json, model.safetensors, logits.npy)."""
    return make_models(hf, FAMILIES, tmp_path_factory.mktemp("models"))


def _hf_weights(folder: Path) -> dict[str, np.ndarray]:
    return load_file(str(folder / "model.safetensors"))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _to_mindformers(preset: str, folder: Path) -> dict[str, np.ndarray]:
    weights = _hf_weights(folder)
    model_map = preset_map(preset, weights, _config(folder))
    assert model_map.ops == PRESETS[preset].ops(FROM_HF)
    mf, report = materialize(model_map, weights)
    assert report.unmatched == ()
    return mf


EXPECTED_LAYER0 = {  # MindFormers names of layer 0 and their shapes (hidden 64, heads 4, kv 2, ffn 80)
    "llama": {
        "model.layers.0.attention.wq.weight": (64, 64),
        "model.layers.0.attention.wk.weight": (32, 64),
        "model.layers.0.attention.wv.weight": (32, 64),
        "model.layers.0.attention.wo.weight": (64, 64),
        "model.layers.0.feed_forward.w1.weight": (80, 64),
        "model.layers.0.feed_forward.w2.weight": (64, 80),
        "model.layers.0.feed_forward.w3.weight": (80, 64),
        "model.layers.0.attention_norm.weight": (64,),
        "model.layers.0.ffn_norm.weight": (64,),
    },
    "llama-qkv-concat": {
        "model.layers.0.attention.w_qkv.weight": (128, 64),
        "model.layers.0.attention.wo.weight": (64, 64),
        "model.layers.0.feed_forward.w_gate_hidden.weight": (160, 64),
        "model.layers.0.feed_forward.w2.weight": (64, 80),
        "model.layers.0.attention_norm.weight": (64,),
        "model.layers.0.ffn_norm.weight": (64,),
    },
    "qwen2.5": {
        "decoder.layers.0.self_attention.linear_q.weight": (64, 64),
        "decoder.layers.0.self_attention.linear_q.bias": (64,),
        "decoder.layers.0.self_attention.linear_k.weight": (32, 64),
        "decoder.layers.0.self_attention.linear_k.bias": (32,),
        "decoder.layers.0.self_attention.linear_v.weight": (32, 64),
        "decoder.layers.0.self_attention.linear_v.bias": (32,),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64),
        "decoder.layers.0.mlp.gating.weight": (80, 64),
        "decoder.layers.0.mlp.hidden.weight": (80, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 80),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
    },
    "qwen3": {
        "decoder.layers.0.self_attention.linear_qkv.weight": (192, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 96),
        "decoder.layers.0.self_attention.q_layernorm.weight": (24,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (24,),
        "decoder.layers.0.mlp.linear_fc1.weight": (160, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 80),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
    },
    "qwen3-moe": {
        "decoder.layers.0.self_attention.linear_qkv.weight": (128, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64),
        "decoder.layers.0.self_attention.q_layernorm.weight": (16,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (16,),
        "decoder.layers.0.mlp.router.weight": (4, 64),
        "decoder.layers.0.mlp.experts.weight1": (4 * 64, 2 * 32),
        "decoder.layers.0.mlp.experts.weight2": (4 * 32, 64),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
    },
    "deepseek-v3": {  # layer 0 is dense (first_k_dense_replace 1)
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": (32, 64),
        "decoder.layers.0.self_attention.q_layernorm.weight": (32,),
        "decoder.layers.0.self_attention.linear_q_up_proj.weight": (4 * 24, 32),
        "decoder.layers.0.self_attention.linear_kv_down_proj.weight": (16 + 8, 64),
        "decoder.layers.0.self_attention.kv_layernorm.weight": (16,),
        "decoder.layers.0.self_attention.linear_kv_up_proj.weight": (4 * (16 + 16), 16),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 4 * 16),
        "decoder.layers.0.mlp.gating.weight": (80, 64),
        "decoder.layers.0.mlp.hidden.weight": (80, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 80),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
    },
}
TOP = {
    "llama": ("model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight"),
    "qwen": ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"),
}


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_hf_to_mindformers_names_and_shapes(tiny, preset):
    mf = _to_mindformers(preset, tiny[preset])
    layer0 = {n: tuple(a.shape) for n, a in mf.items() if n.startswith(("model.layers.0.", "decoder.layers.0."))}
    assert layer0 == EXPECTED_LAYER0[preset]
    top = TOP["llama" if preset.startswith("llama") else "qwen"]
    assert set(top) <= set(mf)
    layer1 = [n for n in mf if ".layers.1." in n]
    if preset == "deepseek-v3":  # layer 1 is a MoE layer: router, shared experts, grouped experts
        assert {
            "decoder.layers.1.mlp.router.weight",
            "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.1.mlp.shared_experts.gating.weight",
            "decoder.layers.1.mlp.experts.weight1",
            "decoder.layers.1.mlp.experts.weight2",
        } <= set(layer1)
        assert mf["decoder.layers.1.mlp.experts.weight1"].shape == (4 * 64, 2 * 32)
    else:
        assert len(layer1) == len(layer0)


# MindFormers 2.1.0's own conversion functions on the same Hugging Face weights (oracle venv).
ORACLE_CONVERT = """
import numpy as np
from safetensors.numpy import load_file, save_file
from mindformers.utils.convert_utils import qkv_concat_hf2mg, ffn_concat_hf2mg
from mindformers.models.llama.convert_weight import name_replace as llama_hf2ms
from mindformers.models.qwen2.utils import Qwen2PreTrainedModel
from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM as Qwen3
preset, hf_path, out_path, cfg = ARGS["preset"], ARGS["hf"], ARGS["out"], ARGS["config"]
hf = load_file(hf_path)
heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
head_dim, ffn = cfg.get("head_dim") or hidden // heads, cfg["intermediate_size"]
mf = {}
if preset.startswith("llama"):
    mf = {llama_hf2ms(n): a for n, a in hf.items()}
    if preset == "llama-qkv-concat":
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            qkv = np.concatenate([mf.pop(p + f"attention.w{x}.weight") for x in "qkv"], 0)
            mf[p + "attention.w_qkv.weight"] = qkv_concat_hf2mg(qkv, heads, kv, hidden)
            gh = np.concatenate([mf.pop(p + "feed_forward.w1.weight"), mf.pop(p + "feed_forward.w3.weight")], 0)
            mf[p + "feed_forward.w_gate_hidden.weight"] = ffn_concat_hf2mg(gh, ffn)
elif preset == "qwen2.5":
    mapping = Qwen2PreTrainedModel.weight_mapping
    for n, a in hf.items():
        for old, new in mapping:
            n = n.replace(old, new)
        mf[n] = a
elif preset in ("qwen3-moe", "deepseek-v3"):  # MindFormers' own ops: QKVConvertOp, ExpertsConvertOp, weight mapping
    from mindformers.checkpoint.converter.convert_op import ExpertsConvertOp, QKVConvertOp
    from mindformers.models.qwen3_moe.utils import Qwen3MoePreTrainedModel
    from mindformers.models.deepseek3.utils import DeepseekV3PreTrainedModel
    deepseek = preset == "deepseek-v3"
    mapping = (DeepseekV3PreTrainedModel if deepseek else Qwen3MoePreTrainedModel).weight_mapping
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]
    moe_ffn = cfg["moe_intermediate_size"]
    qkv = QKVConvertOp(hf_names=["q", "k", "v"], mf_names=["qkv"])
    qkv.num_attention_heads, qkv.num_query_groups, qkv.kv_channels, qkv.hidden_size = heads, kv, head_dim, hidden
    qkv.tensor_model_parallel_size = qkv.optimizer_parallel_size = 1
    def experts_op(parts):
        op = ExpertsConvertOp(hf_names=parts, mf_names=["w"])
        op.num_moe_experts, op.hidden_size, op.moe_ffn_hidden_size = experts, hidden, moe_ffn
        op.expert_parallel_size = op.optimizer_parallel_size = 1
        return op
    for i in range(cfg["num_hidden_layers"]):
        p, d = f"model.layers.{i}.", f"decoder.layers.{i}."
        if not deepseek:
            mf[d + "self_attention.linear_qkv.weight"] = qkv._hf_to_mf(
                [hf.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])[0]
        if p + "mlp.experts.0.gate_proj.weight" not in hf:
            continue
        stacked = {x: np.stack([hf.pop(p + f"mlp.experts.{e}.{x}_proj.weight") for e in range(experts)])
                   for x in ("gate", "up", "down")}
        mf[d + "mlp.experts.weight1"] = experts_op(["g", "u"])._hf_to_mf([stacked["gate"], stacked["up"]])[0]
        mf[d + "mlp.experts.weight2"] = experts_op(["d"])._hf_to_mf([stacked["down"]])[0]
    for n, a in hf.items():
        for old, new in mapping:
            if old in n:  # as MindFormers' convert_name: each pair replaced where it occurs
                n = n.replace(old, new)
        mf[n] = a
else:  # qwen3: the training model's mixin concatenations (interleaved QKV per group, interleaved fc1)
    mapping = Qwen3.weight_mapping
    named = {}
    for n, a in hf.items():
        for old, new in mapping:
            n = n.replace(old, new)
        named[n] = a
    for n, a in named.items():
        if ".linear_q." in n:
            k, v = named[n.replace("linear_q", "linear_k")], named[n.replace("linear_q", "linear_v")]
            mf.update(Qwen3.concat_qkv_interleaved(None, a, k, v, n, head_dim, kv, heads))
        elif ".gating." in n:
            mf.update(Qwen3.concat_linear_fc1_interleaved(None, a, named[n.replace("gating", "hidden")], n, ffn))
        elif not any(f".{x}." in n for x in ("linear_k", "linear_v", "hidden")):
            mf[n] = a
save_file({n: np.ascontiguousarray(a) for n, a in mf.items()}, out_path)
out(sorted(mf))
"""


def test_mindformers_own_conversion_agrees(tiny, oracle, tmp_path):
    for preset in FAMILIES:
        folder = tiny[preset]
        out = tmp_path / f"{preset}.safetensors"
        args = {"preset": preset, "hf": str(folder / "model.safetensors"), "out": str(out), "config": _config(folder)}
        oracle(ORACLE_CONVERT, args, cwd=str(tmp_path))  # MindFormers writes ./output/log there
        theirs = load_file(str(out))
        ours = _to_mindformers(preset, folder)
        assert sorted(ours) == sorted(theirs), preset
        for name, array in theirs.items():
            assert ours[name].dtype == array.dtype and ours[name].shape == array.shape, (preset, name)
            assert ours[name].tobytes() == array.tobytes(), (preset, name)


def _write_hf(folder: Path, weights: dict[str, np.ndarray], config_from: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: np.ascontiguousarray(a) for n, a in weights.items()}, str(folder / "model.safetensors"))
    shutil.copy(config_from / "config.json", folder / "config.json")


@pytest.fixture(scope="module")
def exported(tiny, hf, tmp_path_factory):
    """preset -> transformers' loading info and logits check of its MindFormers -> Hugging Face export."""
    loads = []
    for preset, folder in tiny.items():
        mf = _to_mindformers(preset, folder)
        model_map = preset_map(preset, mf, _config(folder))
        assert direction_for(PRESETS[preset], mf) == TO_HF
        back, report = materialize(model_map, mf)
        assert report.unmatched == ()
        out = tmp_path_factory.mktemp("export")
        _write_hf(out, back, folder)
        loads.append((out, folder / "logits.npy"))
    return dict(zip(tiny, load_models(hf, loads), strict=True))


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_mindformers_to_hf_loads_with_the_original_logits(exported, preset):
    got = exported[preset]
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["equal"], got["max_diff"]


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_mindformers_names_round_trip_byte_identical(tiny, preset):
    folder = tiny[preset]
    mf = _to_mindformers(preset, folder)
    # optimizer states follow their weights both ways
    mf.update({"adam_m." + n: a * 2 for n, a in mf.items()})
    mf["global_step"] = np.array([7], dtype=np.int32)
    config = _config(folder)
    hf_side, report = materialize(preset_map(preset, mf, config), mf)
    assert report.unmatched == ("global_step",)
    assert any(n.startswith("adam_m.model.layers.0.self_attn.") for n in hf_side)
    again, _ = materialize(preset_map(preset, hf_side, config, FROM_HF), hf_side)
    assert list(again) == list(mf)
    for name, array in mf.items():
        assert again[name].dtype == array.dtype and again[name].tobytes() == array.tobytes(), name


def test_llama_needs_no_config_for_renames():
    model_map = preset_map("llama", ["model.layers.3.attention.wq.weight"])
    assert model_map.name == "preset llama"


@pytest.mark.parametrize("preset", ["llama-qkv-concat", "qwen3"])
def test_surgery_without_config_names_the_missing_key(tiny, preset):
    names = list(_to_mindformers(preset, tiny[preset]))
    with pytest.raises(UsageError, match=r"needs 'num_key_value_heads'.*--hf-config"):
        preset_map(preset, names)
    with pytest.raises(UsageError, match=r"needs 'intermediate_size'.*lacks it"):
        preset_map(preset, names, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})


def test_preset_of_another_family_is_refused(tiny):
    qwen_names = _to_mindformers("qwen3", tiny["qwen3"])
    catalogue = {n: TensorInfo(tuple(a.shape), str(a.dtype)) for n, a in qwen_names.items()}
    applied = apply(preset_map("llama", catalogue), catalogue)
    with pytest.raises(UsageError, match="is it for another model family"):
        check_family(applied.report, len(catalogue), "preset llama")


def test_unknown_preset_lists_the_presets():
    with pytest.raises(UsageError, match="unknown preset 'mistral'; the presets are: llama, llama-qkv-concat"):
        preset_map("mistral", [])
