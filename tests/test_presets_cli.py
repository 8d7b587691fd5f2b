"""``--preset`` / ``--hf --preset`` / ``--hf-config`` through the CLI (subprocesses), checked with ``transformers``.

A tiny random Qwen3 and LLaMA (qkv_concat names) made with ``transformers`` go Hugging Face ->
MindFormers names -> Hugging Face shards; ``from_pretrained`` on the output gives exactly the
original logits, and the MindFormers names round-trip byte-identical. The demo's 8-rank
MindFormers (legacy llama names) checkpoint goes to Hugging Face with ``--preset llama`` and loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.hf import load_models, make_models

MOE = {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "head_dim": 16}
CASES = {
    "qwen3": ("qwen3", {"head_dim": 24}),
    "llama-qkv-concat": ("llama", {}),
    "qwen2.5": ("qwen2", {}),
    "qwen3-moe": ("qwen3_moe", MOE),
}
MINDFORMERS_NAME = {  # a MindFormers name of layer 0 each preset's output must hold
    "qwen3": "decoder.layers.0.self_attention.linear_qkv.weight",
    "llama-qkv-concat": "model.layers.0.attention.w_qkv.weight",
    "qwen2.5": "decoder.layers.0.self_attention.linear_q.bias",
    "qwen3-moe": "decoder.layers.1.mlp.experts.weight1",
}


def reshard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    proc = reshard(*args)
    assert proc.returncode == 0, proc.stderr
    return proc


def tensors(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def tiny(hf, tmp_path_factory):
    return make_models(hf, CASES, tmp_path_factory.mktemp("models"))


def ckpt_tensors(ckpt: Path, tmp: Path) -> dict[str, np.ndarray]:
    """The tensors of a .ckpt, read through a plain (no map) conversion to safetensors."""
    ok("convert", str(ckpt), str(tmp), "--to", "safetensors")
    return tensors(tmp)


@pytest.mark.parametrize("preset", list(CASES))
def test_hf_to_mindformers_to_hf_with_the_original_logits(tiny, hf, tmp_path, preset):
    src = tiny[preset]
    config = str(src / "config.json")
    # Hugging Face -> MindFormers names (a .ckpt, as MindSpore loads it)
    ok(
        "convert",
        str(src / "model.safetensors"),
        str(tmp_path / "mf"),
        "--to",
        "ckpt",
        "--preset",
        preset,
        "--hf-config",
        config,
    )
    [mf_file] = sorted((tmp_path / "mf").glob("*.ckpt"))
    mf = ckpt_tensors(mf_file, tmp_path / "mf_read")
    assert not any(".self_attn." in n or ".mlp.gate_proj." in n for n in mf)
    assert MINDFORMERS_NAME[preset] in mf

    # MindFormers names -> Hugging Face shards + the config, loaded by transformers: the original logits
    proc = ok(
        "convert",
        str(mf_file),
        str(tmp_path / "hf"),
        "--to",
        "safetensors",
        "--hf",
        "--preset",
        preset,
        "--hf-config",
        config,
    )
    assert ("renamed" if preset == "qwen2.5" else "unstack" if preset == "qwen3-moe" else "split") in proc.stderr
    out = tmp_path / "hf"
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    [got] = load_models(hf, [(out, src / "logits.npy")])
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["equal"], got["max_diff"]
    original = tensors(src)
    exported = tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(exported[n].tobytes() == original[n].tobytes() for n in original)

    # MindFormers names -> Hugging Face -> MindFormers names: byte-identical, tensor by tensor
    ok(
        "convert",
        str(out / "model.safetensors"),
        str(tmp_path / "mf2"),
        "--to",
        "ckpt",
        "--preset",
        preset,
        "--hf-config",
        config,
    )
    [again_file] = sorted((tmp_path / "mf2").glob("*.ckpt"))
    again = ckpt_tensors(again_file, tmp_path / "mf2_read")
    assert list(again) == list(mf)
    for name, array in mf.items():
        assert again[name].dtype == array.dtype and again[name].tobytes() == array.tobytes(), name


DEMO_CONFIG = {  # the demo model's sizes (reshard.synthetic.ModelShape) as a LlamaConfig
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

DEMO_LOGITS = """
model, info = transformers.AutoModelForCausalLM.from_pretrained(
    ARGS["folder"], torch_dtype=torch.float32, output_loading_info=True)
ids = torch.arange(16).reshape(2, 8)
with torch.no_grad():
    logits = model.eval()(ids).logits
out({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
     "finite": bool(torch.isfinite(logits).all()), "shape": list(logits.shape)})
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "d"
    ok("demo", "--dir", str(folder))
    return folder


def test_demo_rank_folders_to_hf_with_preset_llama_load_in_transformers(demo, hf, tmp_path):
    config = demo / "config.json"  # the demo writes its model's config for --hf-config
    assert json.loads(config.read_text()) == DEMO_CONFIG
    out = tmp_path / "hf"
    proc = ok(
        "transform",
        "--src",
        str(demo / "ckpt_8ranks"),
        "--src-strategy",
        str(demo / "merged" / "src_strategy.ckpt"),
        "--dst",
        str(out),
        "--hf",
        "--keep-training-state",
        "--preset",
        "llama",
        "--hf-config",
        str(config),
    )
    assert "renamed" in proc.stderr and "training-state" in proc.stderr
    got = tensors(out)
    assert "model.layers.0.self_attn.q_proj.weight" in got and "model.embed_tokens.weight" in got
    assert "adam_m.model.layers.0.self_attn.q_proj.weight" in got  # optimizer states follow their weights
    # the same as the full model's export, tensor by tensor
    ok(
        "convert",
        str(demo / "full" / "model.ckpt"),
        str(tmp_path / "from_full"),
        "--to",
        "safetensors",
        "--hf",
        "--keep-training-state",
        "--preset",
        "llama",
    )
    full = tensors(tmp_path / "from_full")
    assert sorted(full) == sorted(got)
    assert all(full[n].tobytes() == got[n].tobytes() for n in full)
    loaded = hf(DEMO_LOGITS, {"folder": str(out)})
    assert loaded["missing"] == [] and loaded["finite"] and loaded["shape"] == [2, 8, 512]
    assert all(n.startswith(("adam_m.", "adam_v.", "global_step", "learning_rate")) for n in loaded["unexpected"])

    # the README's export: --weights-only leaves exactly the model transformers builds
    lean = tmp_path / "lean"
    ok(
        "transform",
        "--src",
        str(demo / "ckpt_8ranks"),
        "--src-strategy",
        str(demo / "merged" / "src_strategy.ckpt"),
        "--dst",
        str(lean),
        "--hf",
        "--preset",
        "llama",
        "--weights-only",
        "--hf-config",
        str(config),
    )
    training = ("adam_", "global_step", "learning_rate")
    assert sorted(tensors(lean)) == sorted(n for n in got if not n.startswith(training))
    loaded = hf(DEMO_LOGITS, {"folder": str(lean)})
    assert loaded["missing"] == [] and loaded["unexpected"] == [] and loaded["finite"]


def _one_line_exit_2(proc: subprocess.CompletedProcess[str], text: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert text in lines[0], lines[0]


def test_bad_input(tiny, demo, tmp_path):
    qwen = tiny["qwen3"]
    config = str(qwen / "config.json")
    ok(
        "convert",
        str(qwen / "model.safetensors"),
        str(tmp_path / "mf"),
        "--to",
        "ckpt",
        "--preset",
        "qwen3",
        "--hf-config",
        config,
    )
    [mf_file] = sorted((tmp_path / "mf").glob("*.ckpt"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_attention_heads": 4,')
    yaml_config = tmp_path / "model.yaml"  # a MindFormers YAML gives sizes, but is no config.json to copy
    yaml_config.write_text("model:\n  model_config:\n    num_attention_heads: 4\n")
    cases = [
        # a preset for another family: most names unmatched
        (["convert", str(mf_file), "--to", "safetensors", "--hf", "--preset", "llama"], "another model family"),
        (
            [
                "convert",
                str(demo / "full" / "model.ckpt"),
                "--to",
                "safetensors",
                "--preset",
                "qwen3",
                "--hf-config",
                config,
            ],
            "another model family",
        ),
        (
            [
                "convert",
                str(mf_file),
                "--to",
                "safetensors",
                "--hf",
                "--preset",
                "qwen3",
                "--hf-config",
                str(yaml_config),
            ],
            "must be a JSON object",
        ),
        # surgery without the config's sizes
        (["convert", str(mf_file), "--to", "safetensors", "--hf", "--preset", "qwen3"], "'num_key_value_heads'"),
        # a config.json that is not one
        (
            ["convert", str(mf_file), "--to", "safetensors", "--hf", "--preset", "qwen3", "--hf-config", str(bad)],
            "does not parse",
        ),
        (
            [
                "convert",
                str(mf_file),
                "--to",
                "safetensors",
                "--hf",
                "--preset",
                "qwen3",
                "--hf-config",
                str(tmp_path / "absent.json"),
            ],
            "cannot read model config",
        ),
        # --hf-config with neither --hf nor --preset: nothing would use it
        (["convert", str(mf_file), "--to", "safetensors", "--hf-config", config], "--hf-config"),
        # two maps at once
        (["convert", str(mf_file), "--to", "safetensors", "--preset", "qwen3", "--rename", config], "two name maps"),
    ]
    for k, (args, text) in enumerate(cases):
        dst = tmp_path / f"out{k}"
        proc = reshard(*args[:2], str(dst), *args[2:])
        _one_line_exit_2(proc, text)
        assert not dst.exists(), args
    proc = reshard("convert", str(mf_file), str(tmp_path / "x"), "--to", "safetensors", "--preset", "mistral")
    assert proc.returncode == 2 and "llama" in proc.stderr and not (tmp_path / "x").exists()
    assert os.listdir(tmp_path / "mf")  # the inputs are untouched


def test_strict_refuses_what_the_preset_leaves_unmatched(demo, tmp_path):
    full = str(demo / "full" / "model.ckpt")
    proc = reshard(
        "convert", full, str(tmp_path / "a"), "--to", "safetensors", "--hf", "--keep-training-state",
        "--preset", "llama", "--strict",
    )  # fmt: skip
    _one_line_exit_2(proc, "--strict")
    assert "global_step" in proc.stderr and not (tmp_path / "a").exists()
    # without training state every name is the preset's
    ok(
        "convert",
        full,
        str(tmp_path / "b"),
        "--to",
        "safetensors",
        "--hf",
        "--preset",
        "llama",
        "--strict",
        "--weights-only",
    )
    assert "model.layers.3.mlp.down_proj.weight" in tensors(tmp_path / "b")


def test_demo_round_trip_through_hf_names_without_a_config(demo, tmp_path):
    """llama only renames, so no config; kept training state (optimizer states, step counters) comes back too."""
    full = demo / "full" / "model.ckpt"
    ok(
        "convert",
        str(full),
        str(tmp_path / "hf"),
        "--to",
        "safetensors",
        "--hf",
        "--keep-training-state",
        "--preset",
        "llama",
    )
    ok("convert", str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "mf"), "--to", "ckpt", "--preset", "llama")
    original = ckpt_tensors(full, tmp_path / "a")
    again = ckpt_tensors(tmp_path / "mf" / "model.ckpt", tmp_path / "b")
    assert sorted(again) == sorted(original)
    for name, array in original.items():
        assert again[name].dtype == array.dtype and again[name].tobytes() == array.tobytes(), name
