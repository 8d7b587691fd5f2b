"""Megatron-core names (``naming/megatron.py``), maps in stages (``naming/stages.py``) and views (``plan/views.py``).

Each map is checked against a numpy reference that materialises the pieces and rearranges the
tensors by hand: Megatron-core's stacked layers and experts, Q/K/V grouped per query group and
``[gate; up]``; and round trips (Megatron -> Hugging Face -> Megatron, MindFormers -> Megatron ->
MindFormers) are exact.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import UsageError
from reshard.naming import Derived, TensorInfo, apply
from reshard.naming.megatron import world_map
from reshard.plan import views

L, E, H, FFN, MOE_FFN = 2, 4, 64, 96, 32
CONFIG = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_size": H,
    "intermediate_size": FFN,
    "moe_intermediate_size": MOE_FFN,
    "num_experts": E,
}
QKV = (4 * 16 + 2 * 2 * 16, H)


def materialise(d: Derived, arrays: dict[str, np.ndarray]) -> np.ndarray:
    out = np.zeros(d.shape, dtype=np.float32)
    for p in d.pieces:
        src = arrays[p.source].reshape(p.view or arrays[p.source].shape)
        box = src[tuple(slice(s, s + n) for s, n in zip(p.src_start, p.src_lengths, strict=True))]
        box = box if p.perm is None else np.transpose(box, p.perm)
        out[tuple(slice(s, s + n) for s, n in zip(p.dst_start, p.lengths, strict=True))] = box
    return out


def run(model_map, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    applied = apply(model_map, {n: TensorInfo(a.shape, "Float32") for n, a in arrays.items()})
    assert not applied.report.unmatched
    return {d.name: materialise(d, arrays) for d in applied.outputs}


def stacked_moe(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {
        "embedding.word_embeddings.weight": (96, H),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.weight": (L, *QKV),
        "decoder.layers.self_attention.q_layernorm.weight": (L, 16),
        "decoder.layers.self_attention.k_layernorm.weight": (L, 16),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, 64),
        "decoder.layers.pre_mlp_layernorm.weight": (L, H),
        "decoder.layers.mlp.router.weight": (L, E, H),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * MOE_FFN, H),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, MOE_FFN),
        "decoder.final_layernorm.weight": (H,),
        "output_layer.weight": (96, H),
    }
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def test_stacked_moe_to_hf_matches_reference() -> None:
    src = stacked_moe(np.random.default_rng(0))
    out = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), src)
    qkv = src["decoder.layers.self_attention.linear_qkv.weight"][1].reshape(2, 4, 16, H)  # groups x [q, q, k, v]
    np.testing.assert_array_equal(out["model.layers.1.self_attn.q_proj.weight"], qkv[:, :2].reshape(64, H))
    np.testing.assert_array_equal(out["model.layers.1.self_attn.v_proj.weight"], qkv[:, 3].reshape(32, H))
    fc1 = src["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1, 3]
    np.testing.assert_array_equal(out["model.layers.1.mlp.experts.3.gate_proj.weight"], fc1[:MOE_FFN])
    np.testing.assert_array_equal(out["model.layers.1.mlp.experts.3.up_proj.weight"], fc1[MOE_FFN:])
    fc2 = src["decoder.layers.mlp.experts.experts.linear_fc2.weight"][0, 2]
    np.testing.assert_array_equal(out["model.layers.0.mlp.experts.2.down_proj.weight"], fc2)
    norm = src["decoder.layers.pre_mlp_layernorm.weight"][1]
    np.testing.assert_array_equal(out["model.layers.1.post_attention_layernorm.weight"], norm)
    assert len(out) == 3 + L * (9 + 3 * E)


def test_round_trips_are_exact() -> None:
    src = stacked_moe(np.random.default_rng(1))
    hf = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), src)
    back = run(world_map("qwen3-moe", "hf", "megatron", CONFIG), hf)
    assert sorted(back) == sorted(src)
    for name, array in src.items():
        np.testing.assert_array_equal(back[name], array)
    mindformers = run(world_map("qwen3-moe", "megatron", "mindformers", CONFIG), src)
    assert "decoder.layers.1.mlp.experts.weight1" in mindformers
    again = run(world_map("qwen3-moe", "mindformers", "megatron", CONFIG), mindformers)
    for name, array in src.items():
        np.testing.assert_array_equal(again[name], array)


def test_per_layer_state_dict_names_read_like_stacked() -> None:
    src = stacked_moe(np.random.default_rng(2))
    per_layer = {}
    for name, array in src.items():
        if not name.startswith("decoder.layers.") or name.startswith("decoder.layers.mlp.experts"):
            per_layer[name] = array
            continue
        rest = name[len("decoder.layers.") :].replace(
            "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"
        )
        for layer in range(L):
            per_layer[f"decoder.layers.{layer}.{rest}"] = array[layer]
    for layer in range(L):
        for e in range(E):  # Transformer Engine's grouped experts: linear_fc1.weightE
            for fc in ("linear_fc1", "linear_fc2"):
                grouped = src[f"decoder.layers.mlp.experts.experts.{fc}.weight"]
                per_layer[f"decoder.layers.{layer}.mlp.experts.{fc}.weight{e}"] = grouped[layer, e]
    per_layer = {n: a for n, a in per_layer.items() if not n.startswith("decoder.layers.mlp.experts")}
    expected = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), src)
    got = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), per_layer)
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array)


def test_world_map_refusals() -> None:
    with pytest.raises(UsageError, match="one side must be megatron"):
        world_map("llama", "hf", "mindformers", CONFIG)
    with pytest.raises(UsageError, match="no Megatron-core names"):
        world_map("llama-qkv-concat", "megatron", "hf", CONFIG)
    with pytest.raises(UsageError, match=r"'num_key_value_heads'.*--hf-config"):
        world_map("llama", "megatron", "hf", None)


def test_views() -> None:
    assert views.runs((6, 4), (2, 3, 4)) == ((0, 1), (2,))
    assert views.runs((1, 3, 4), (3, 4)) == ((), (0,), (1,))
    assert views.runs((5, 4), (2, 3, 4)) is None
    runs = views.runs((24, 4), (2, 3, 4, 4))
    assert views.to_tensor(runs, (2, 3, 4, 4), (16, 0), (4, 4)) == ((1, 1, 0, 0), (1, 1, 4, 4))
    assert views.to_tensor(runs, (2, 3, 4, 4), (2, 0), (4, 4)) is None  # spans two experts, partly
    assert views.to_view(runs, (2, 3, 4, 4), (1, 1, 2, 0), (1, 1, 2, 4)) == ((18, 0), (2, 4))
    assert views.to_view(runs, (2, 3, 4, 4), (0, 1, 0, 0), (2, 1, 4, 4)) is None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_refusals(tmp_path) -> None:
    proc = cli("transform", "--src", str(tmp_path), "--dst", str(tmp_path / "o"), "--src-names", "megatron")
    assert proc.returncode == 2 and "need --preset" in proc.stderr
    proc = cli(
        "transform",
        "--src",
        str(tmp_path),
        "--dst",
        str(tmp_path / "o"),
        "--hf",
        "--preset",
        "llama",
        "--dst-names",
        "megatron",
    )
    assert proc.returncode == 2 and "contradicts" in proc.stderr


def test_singleton_local_shards_experts() -> None:
    """``dist_checkpointing``'s ``singleton_local_shards``: one key per expert, stacked on layers only."""
    src = stacked_moe(np.random.default_rng(3))
    singleton = {n: a for n, a in src.items() if not n.startswith("decoder.layers.mlp.experts")}
    for fc in ("linear_fc1", "linear_fc2"):
        grouped = src[f"decoder.layers.mlp.experts.experts.{fc}.weight"]
        for e in range(E):
            singleton[f"decoder.layers.mlp.experts.experts.{e}.{fc}.weight"] = grouped[:, e]
    expected = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), src)
    got = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), singleton)
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array)


DEEPSEEK = {
    "hidden_size": H,
    "num_attention_heads": 4,
    "intermediate_size": FFN,
    "moe_intermediate_size": MOE_FFN,
    "n_shared_experts": 1,
    "n_routed_experts": E,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
}


def deepseek_per_layer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """megatron-core's DeepSeek-V3 distributed-checkpoint names (MLA, Transformer Engine spelling): a dense
    layer 0 and a MoE layer 1, saved per layer (its layers differ), the experts stacked per layer."""
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (96, H),
        "output_layer.weight": (96, H),
        "decoder.final_layernorm.weight": (H,),
    }
    for n in range(2):
        a = f"decoder.layers.{n}.self_attention."
        shapes |= {
            f"decoder.layers.{n}.input_layernorm.weight": (H,),
            a + "linear_q_down_proj.weight": (24, H),
            a + "linear_q_up_proj.layer_norm_weight": (24,),
            a + "linear_q_up_proj.weight": (96, 24),
            a + "linear_kv_down_proj.weight": (24, H),
            a + "linear_kv_up_proj.layer_norm_weight": (16,),
            a + "linear_kv_up_proj.weight": (128, 16),
            a + "linear_proj.weight": (H, 64),
        }
    m = "decoder.layers.0.mlp."
    shapes |= {
        m + "linear_fc1.layer_norm_weight": (H,),
        m + "linear_fc1.weight": (2 * FFN, H),
        m + "linear_fc2.weight": (H, FFN),
    }
    m = "decoder.layers.1.mlp."
    shapes |= {
        "decoder.layers.1.pre_mlp_layernorm.weight": (H,),
        m + "router.weight": (E, H),
        m + "router.expert_bias": (E,),
        m + "experts.experts.linear_fc1.weight": (E, 2 * MOE_FFN, H),
        m + "experts.experts.linear_fc2.weight": (E, H, MOE_FFN),
        m + "shared_experts.linear_fc1.weight": (2 * MOE_FFN, H),
        m + "shared_experts.linear_fc2.weight": (H, MOE_FFN),
    }
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def test_deepseek_v3_per_layer_round_trip() -> None:
    src = deepseek_per_layer(np.random.default_rng(4))
    hf = run(world_map("deepseek-v3", "megatron", "hf", DEEPSEEK), src)
    shared = src["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    np.testing.assert_array_equal(hf["model.layers.1.mlp.shared_experts.up_proj.weight"], shared[MOE_FFN:])
    expert = src["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"][2]
    np.testing.assert_array_equal(hf["model.layers.1.mlp.experts.2.gate_proj.weight"], expert[:MOE_FFN])
    np.testing.assert_array_equal(
        hf["model.layers.0.mlp.up_proj.weight"], src["decoder.layers.0.mlp.linear_fc1.weight"][FFN:]
    )
    norm = src["decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight"]
    np.testing.assert_array_equal(hf["model.layers.1.self_attn.kv_a_layernorm.weight"], norm)
    assert (
        "model.layers.0.post_attention_layernorm.weight" in hf
        and "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    )
    back = run(world_map("deepseek-v3", "hf", "megatron", DEEPSEEK), hf)
    assert sorted(back) == sorted(src)  # per layer, the dense layer's norm fused-style, the MoE layer's separate
    for name, array in src.items():
        np.testing.assert_array_equal(back[name], array)


def test_which_layers_stack_and_which_are_dense() -> None:
    from reshard.naming.megatron import dense_layers, stacks_layers

    assert stacks_layers("llama", {}) and stacks_layers("qwen3-moe", {"mlp_only_layers": []})
    assert not stacks_layers("qwen3-moe", {"mlp_only_layers": [0]}) and not stacks_layers("deepseek-v3", {})
    assert dense_layers("deepseek-v3", {}) == [0, 1, 2]  # transformers' default first_k_dense_replace
    assert dense_layers("qwen3-moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}) == [
        0,
        2,
        3,
    ]
    src = stacked_moe(np.random.default_rng(5))
    hf = run(world_map("qwen3-moe", "megatron", "hf", CONFIG), src)
    per_layer = run(world_map("qwen3-moe", "hf", "megatron", {**CONFIG, "mlp_only_layers": [0]}), hf)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in per_layer
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in per_layer  # dense layer 0: fused-style norm
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in per_layer


def test_cli_mindformers_to_megatron_and_back(tmp_path) -> None:
    """The demo's MindFormers checkpoint (a .ckpt) -> Megatron-core names -> MindFormers names: the same tensors."""
    assert cli("demo", "--dir", str(tmp_path / "demo")).returncode == 0
    demo = tmp_path / "demo"
    config = str(demo / "config.json")
    flags = ("--preset", "llama", "--hf-config", config)
    there = cli(
        "transform",
        str(demo / "full" / "model.ckpt"),
        str(tmp_path / "meg"),
        *flags,
        "--src-names",
        "mindformers",
        "--dst-names",
        "megatron",
        "--weights-only",
    )
    assert there.returncode == 0, there.stderr
    assert "stack" in there.stderr and "decoder.layers.self_attention.linear_qkv.weight" in there.stderr
    back = cli(
        "transform",
        str(tmp_path / "meg"),
        str(tmp_path / "mf"),
        *flags,
        "--src-names",
        "megatron",
        "--dst-names",
        "mindformers",
        "--output-format",
        "ckpt",
    )
    assert back.returncode == 0, back.stderr
    same = cli("verify", str(demo / "full" / "model.ckpt"), str(tmp_path / "mf"), "--weights-only")
    assert same.returncode == 0 and "SAME: 39 match, 0 differ" in same.stdout


# --------------------------------------------------------------------------------------------
# stages compose: the composed pieces give what applying each stage to the previous one's arrays gives


def staged_equals_sequential(stages: list[tuple], arrays: dict[str, np.ndarray]) -> None:
    from reshard.naming import ModelMap
    from reshard.naming import ops as single

    chained = None
    for stage in reversed(stages):
        chained = ModelMap(stage, {}, "t", chained)
    composed = run(chained, arrays)
    current = arrays
    for stage in stages:
        applied = single.apply(ModelMap(stage), {n: TensorInfo(a.shape, "Float32") for n, a in current.items()})
        current = {d.name: materialise(d, current) for d in applied.outputs}
    assert sorted(composed) == sorted(current)
    for name, array in current.items():
        np.testing.assert_array_equal(composed[name], array)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_unstack_transpose_split_compose(data) -> None:
    """Megatron-core to Hugging Face's chain: unstack a layer axis (a merged view), permute, split in groups."""
    from reshard.naming import Split, Transpose, Unstack

    layers, groups, period = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(2, 4))
    axis, other = data.draw(st.integers(0, 1)), data.draw(st.integers(1, 4))
    first = data.draw(st.integers(1, period - 1))  # rows of part a per group
    transposed = (groups * period, other) if axis == 0 else (other, groups * period)
    x = np.random.default_rng(0).standard_normal((layers, transposed[1], transposed[0])).astype(np.float32)
    stages = [
        (Unstack("x", "x.{expert}", 0),),
        (Transpose(r"x\.(\d+)", r"t.\1", (1, 0)),),
        (Split(r"t\.(\d+)", (r"a.\1", r"b.\1"), axis, (groups * first, -1), groups),),
    ]
    staged_equals_sequential(stages, {"x": x})


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_transpose_join_stack_stack_compose(data) -> None:
    from reshard.naming import Join, Stack, Transpose

    layers, experts = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    rows, cols = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    perm = data.draw(st.permutations((0, 1)))
    axis = data.draw(st.integers(0, 2))
    rng = np.random.default_rng(1)
    arrays = {
        f"{part}.{layer}.{e}": rng.standard_normal((rows, cols)).astype(np.float32)
        for part in "gu"
        for layer in range(layers)
        for e in range(experts)
    }
    stages = [
        (Transpose(r"(.)\.(\d+)\.(\d+)", r"\1.\2.\3", tuple(perm)),),
        (Join((r"g\.(\d+)\.(\d+)", r"u\.(\d+)\.(\d+)"), r"fc.\1.\2", 0),),
        (Stack(r"fc\.(\d+)\.(?P<expert>\d+)", r"e.\1", axis),),
        (Stack(r"e\.(?P<expert>\d+)", "stacked", 0),),
    ]
    staged_equals_sequential(stages, arrays)
