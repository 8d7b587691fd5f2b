"""A given model config agrees with the derived shapes (issue 18 item 1): checked before writing.

``--hf-config`` of another model size was used for a preset's sizes or copied beside the shards
as it was, exit 0, and ``transformers`` refused the output later (or a split cut the wrong rows).
Now the full tensors a run reads or writes are compared with the config's sizes
(``reshard.naming.shapes``): a disagreement is one line naming the tensor, its shape and the
config key and value, nothing written. The demo writes its model's ``config.json``; the wrong
configs here change one key each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard.errors import UsageError
from reshard.naming.shapes import check_config_shapes
from tests.trust_helpers import run_cli as run
from tests.trust_helpers import snapshot

LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@pytest.mark.parametrize(
    ("name", "shape", "change", "said"),
    [
        ("model.embed_tokens.weight", (512, 128), {"vocab_size": 1024}, "vocab_size = 1024 gives dim 0 1024"),
        ("lm_head.weight", (512, 128), {"hidden_size": 64}, "hidden_size = 64 gives dim 1 64"),
        ("model.layers.1.input_layernorm.weight", (128,), {"hidden_size": 256}, "hidden_size = 256"),
        (
            "model.layers.0.self_attn.q_proj.weight",
            (128, 128),
            {"num_attention_heads": 8, "head_dim": 32},
            "num_attention_heads*head_dim = 256 (num_attention_heads 8, head_dim 32) gives dim 0 256",
        ),
        ("model.layers.0.self_attn.k_proj.weight", (128, 128), {"num_key_value_heads": 2}, "num_key_value_heads 2"),
        ("model.layers.0.self_attn.o_proj.weight", (128, 128), {"head_dim": 16}, "gives dim 1 64"),
        ("model.layers.0.mlp.down_proj.weight", (128, 256), {"intermediate_size": 512}, "intermediate_size = 512"),
        ("model.layers.4.mlp.up_proj.weight", (256, 128), {}, "is layer 4, but the model config's num_hidden_layers"),
        # MindFormers' names a preset renames are read as their Hugging Face names, optimizer states as their weight
        ("model.layers.0.feed_forward.w1.weight", (256, 128), {"intermediate_size": 64}, "intermediate_size = 64"),
        ("adam_m.decoder.layers.0.mlp.linear_fc2.weight", (128, 256), {"intermediate_size": 8}, "dim 1 8"),
        ("model.tok_embeddings.embedding_weight", (512, 128, 1), {}, "describes a 2-D tensor"),
    ],
)
def test_a_shape_the_config_contradicts_is_named(name: str, shape: tuple[int, ...], change: dict, said: str) -> None:
    with pytest.raises(UsageError, match="is it this model's config") as caught:
        check_config_shapes([(name, shape)], {**LLAMA, **change}, "config.json")
    text = str(caught.value)
    assert text.startswith(f"config.json: {name} is ") and said in text, text


def test_what_agrees_or_is_not_described_passes() -> None:
    tensors = [
        ("model.embed_tokens.weight", (512, 128)),
        ("model.layers.3.self_attn.q_proj.weight", (128, 128)),  # head_dim defaults to hidden / heads
        ("model.layers.3.mlp.gate_proj.weight", (256, 128)),
        ("model.layers.0.attention.wq.weight", (128, 128)),  # the llama preset's MindFormers name
        ("global_step", (1,)),  # not described by a config
        ("model.visual.patch_embed.weight", (3, 3)),
    ]
    assert check_config_shapes(tensors, LLAMA) == 4
    # a size whose keys the config lacks is not compared
    assert check_config_shapes([("model.layers.0.mlp.down_proj.weight", (128, 999))], {"hidden_size": 128}) == 1


def test_moe_and_latent_attention_sizes() -> None:
    deepseek = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,  # layer 2 is the multi-token prediction layer
        "moe_intermediate_size": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,  # MLA: the attention projections have their own sizes, not compared
    }
    ok = [
        ("model.layers.2.mlp.experts.7.gate_proj.weight", (16, 64)),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", (64, 32)),
        ("model.layers.1.mlp.gate.weight", (8, 64)),
        ("model.layers.1.self_attn.o_proj.weight", (64, 4 * 128)),
    ]
    assert check_config_shapes(ok, deepseek) == 3
    with pytest.raises(UsageError, match="moe_intermediate_size = 16 gives dim 1 16"):
        check_config_shapes([("model.layers.0.mlp.experts.0.down_proj.weight", (64, 32))], deepseek)
    with pytest.raises(UsageError, match=r"num_experts = 8 gives dim 0 8"):
        check_config_shapes([("model.layers.0.mlp.gate.weight", (16, 64))], deepseek)


# --------------------------------------------------------------------------- the faces, with the demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("demo")
    proc = run("demo", "--dir", str(root))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((root / "config.json").read_text())
    wrong = root / "wrong_ffn.json"
    wrong.write_text(json.dumps({**config, "intermediate_size": 512}))
    hf = root / "hf"
    proc = run(
        "transform", "--src", str(root / "full" / "model.ckpt"), "--dst", str(hf), "--hf", "--preset", "llama",
        "--weights-only", "--hf-config", str(root / "config.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    hf_wrong = root / "hf_wrong"
    shutil.copytree(hf, hf_wrong)
    shutil.copy(wrong, hf_wrong / "config.json")
    return {
        "root": str(root),
        "config": str(root / "config.json"),
        "wrong": str(wrong),
        "r8": str(root / "ckpt_8ranks"),
        "st8": str(root / "st_8ranks"),
        "s8": str(root / "merged" / "src_strategy.ckpt"),
        "s4": str(root / "merged" / "dst_strategy.ckpt"),
        "full": str(root / "full" / "model.ckpt"),
        "hf": str(hf),
        "hf_wrong": str(hf_wrong),
    }


def faces(d: dict[str, str], out: str, config: str) -> dict[str, list[str]]:
    hf = ["--hf", "--preset", "llama", "--hf-config", config]
    return {
        "transform 8 ranks --hf": ["transform", "--src", d["r8"], "--src-strategy", d["s8"], "--dst", out, *hf],
        "transform full --hf": ["transform", "--src", d["full"], "--dst", out, *hf],
        "unify --hf": ["unify", d["st8"], out, "--src-strategy", d["s8"], *hf],
        "transform --hf, no preset": ["transform", "--src", d["full"], "--dst", out, "--hf", "--hf-config", config],
        "Hugging Face -> 4 ranks, a preset": [
            "transform", "--src", d["hf"], "--dst", out, "--dst-strategy", d["s4"], "--preset", "llama",
            "--hf-config", config,
        ],
    }  # fmt: skip


FACES = [
    "transform 8 ranks --hf",
    "transform full --hf",
    "unify --hf",
    "transform --hf, no preset",
    "Hugging Face -> 4 ranks, a preset",
]


@pytest.mark.parametrize("face", FACES)
def test_a_wrong_config_is_refused_before_writing(demo: dict[str, str], tmp_path: Path, face: str) -> None:
    out = tmp_path / "out"
    before = snapshot(demo["root"])
    proc = run(*faces(demo, str(out), demo["wrong"])[face])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"reshard: error: {demo['wrong']}: "), proc.stderr
    assert "intermediate_size = 512" in line and "is it this model's config?" in line, line
    assert proc.stderr.count("reshard: error:") == 1
    assert not out.exists()
    assert snapshot(demo["root"]) == before


@pytest.mark.parametrize("face", FACES)
def test_the_demos_own_config_passes(demo: dict[str, str], tmp_path: Path, face: str) -> None:
    proc = run(*faces(demo, str(tmp_path / "out"), demo["config"])[face])
    assert proc.returncode == 0, proc.stderr


def test_a_hugging_face_folders_own_config_json_is_compared(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("transform", "--src", demo["hf_wrong"], "--dst", str(out), "--output-format", "ckpt")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = proc.stderr.strip().splitlines()[-1]
    assert f"{demo['hf_wrong']}/config.json: model.layers." in line and "intermediate_size = 512" in line, line
    assert not out.exists()
