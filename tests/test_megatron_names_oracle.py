"""Megatron-core names end to end: a real megatron-core ``GPTModel`` -> DCP -> reshard -> ``transformers``.

A tiny LLaMA, Qwen2.5 (Q/K/V biases), Qwen3 and Qwen3-MoE ``GPTModel`` (megatron-core 0.16.1,
local layer spec, CPU) is saved as a DCP folder under its ``sharded_state_dict()`` names (layers
stacked on a leading axis) with plain ``torch.distributed.checkpoint.save``.
``reshard transform --hf --preset F --src-names megatron`` writes Hugging Face shards;
``from_pretrained`` loads them and gives megatron's own forward's logits (CPU), and the tensors
equal megatron's per-layer state dict. The reverse (``--dst-names megatron --output-format dcp``)
gives back the stacked DCP tensors exactly, read with ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.torch_oracle import run_torch_script

LOAD = """
m = transformers.AutoModelForCausalLM.from_pretrained(ARGS["folder"], dtype=torch.float32).eval()
ids = torch.arange(24).reshape(2, 12) % 96
with torch.no_grad():
    logits = m(ids).logits.numpy()
np.save(ARGS["logits"], logits)
out({"ok": True})
"""

HF_OF = {  # a Hugging Face name -> the megatron state-dict name it is (per layer)
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    "model.layers.1.input_layernorm.weight": "decoder.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight": "decoder.layers.1.pre_mlp_layernorm.weight",
    "model.layers.1.self_attn.o_proj.weight": "decoder.layers.1.self_attention.linear_proj.weight",
}
DENSE = {"model.layers.1.mlp.down_proj.weight": "decoder.layers.1.mlp.linear_fc2.weight"}
MOE = {
    "model.layers.1.mlp.gate.weight": "decoder.layers.1.mlp.router.weight",
    "model.layers.0.mlp.experts.3.down_proj.weight": "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
}


def reshard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("family", ["llama", "qwen2.5", "qwen3", "qwen3-moe"])
def test_megatron_dcp_to_hf_and_back(family: str, tmp_path: Path, hf) -> None:
    dcp, config = tmp_path / "dcp", tmp_path / "config.json"
    run_torch_script(
        "megatron_names.py",
        {
            "folder": str(dcp),
            "npz": str(tmp_path / "ref.npz"),
            "logits": str(tmp_path / "megatron.npy"),
            "family": family,
            "config": str(config),
        },
    )
    out = tmp_path / "hf"
    proc = reshard(
        "transform",
        "--src",
        str(dcp),
        "--dst",
        str(out),
        "--hf",
        "--preset",
        family,
        "--src-names",
        "megatron",
        "--hf-config",
        str(config),
        "--strict",
    )
    assert proc.returncode == 0, proc.stderr
    hf(LOAD, {"folder": str(out), "logits": str(tmp_path / "hf.npy")})
    megatron, loaded = np.load(tmp_path / "megatron.npy"), np.load(tmp_path / "hf.npy")
    assert megatron.shape == loaded.shape == (2, 12, 96)
    assert np.abs(megatron - loaded).max() < 1e-4  # megatron's forward and transformers' on the same weights
    ref, got = np.load(tmp_path / "ref.npz"), load_file(out / "model.safetensors")
    moe = family == "qwen3-moe"
    for hf_name, name in {**HF_OF, **(MOE if moe else DENSE)}.items():
        np.testing.assert_array_equal(got[hf_name], ref[name])
    qkv = ref["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(2, 4, 24, 64)  # groups x [q q k v]
    np.testing.assert_array_equal(got["model.layers.0.self_attn.k_proj.weight"], qkv[:, 2].reshape(48, 64))
    if family == "qwen2.5":
        bias = ref["decoder.layers.1.self_attention.linear_qkv.bias"].reshape(2, 4, 24)
        np.testing.assert_array_equal(got["model.layers.1.self_attn.v_proj.bias"], bias[:, 3].reshape(48))
    fc1 = "mlp.experts.local_experts.2.linear_fc1.weight" if moe else "mlp.linear_fc1.weight"
    up = "mlp.experts.2.up_proj.weight" if moe else "mlp.up_proj.weight"
    rows = ref[f"decoder.layers.0.{fc1}"]
    np.testing.assert_array_equal(got[f"model.layers.0.{up}"], rows[rows.shape[0] // 2 :])

    back = tmp_path / "back"
    proc = reshard(
        "transform",
        "--src",
        str(out),
        "--dst",
        str(back),
        "--preset",
        family,
        "--dst-names",
        "megatron",
        "--hf-config",
        str(config),
        "--output-format",
        "dcp",
        "--strict",
    )
    assert proc.returncode == 0, proc.stderr
    for folder, npz in ((dcp, "orig.npz"), (back, "back.npz")):
        run_torch_script("megatron_names.py", {"mode": "load", "folder": str(folder), "npz": str(tmp_path / npz)})
    orig, again = dict(np.load(tmp_path / "orig.npz")), np.load(tmp_path / "back.npz")
    if moe:  # the local spec saves a MoE layer's norm fused-style; reshard writes Transformer Engine's name
        orig["decoder.layers.pre_mlp_layernorm.weight"] = orig.pop("decoder.layers.mlp.linear_fc1.layer_norm_weight")
    assert sorted(orig) == sorted(again)
    for name in orig:
        np.testing.assert_array_equal(again[name], orig[name])
