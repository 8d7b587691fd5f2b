"""The config.json beside a Hugging Face output says how its weights are stored (``plan.output_config``);
transformers loads what ``--quantize`` wrote with experts or everything excluded (oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT32, UINT8
from reshard.plan.output_config import load_dtype, modules_not_converted, rewritten
from tests.trust_helpers import run_cli

B, F8, F = BFLOAT16, FLOAT8_E4M3, FLOAT32


def _pair(module: str) -> list[tuple[str, object, tuple[int, ...]]]:
    return [(f"{module}.weight", F8, (256, 256)), (f"{module}.weight_scale_inv", F, (2, 2))]


def _layer(k: int, experts_quantized: bool) -> list[tuple[str, object, tuple[int, ...]]]:
    out = [*_pair(f"model.layers.{k}.self_attn.q_proj"), (f"model.layers.{k}.input_layernorm.weight", B, (256,))]
    for e in range(2):
        for proj in ("gate_proj", "down_proj"):
            module = f"model.layers.{k}.mlp.experts.{e}.{proj}"
            out += _pair(module) if experts_quantized else [(f"{module}.weight", B, (256, 256))]
    return [*out, (f"model.layers.{k}.mlp.gate.weight", B, (2, 256))]


HEAD = [("model.embed_tokens.weight", B, (64, 256)), ("lm_head.weight", B, (64, 256)), ("model.norm.weight", B, (256,))]


def test_every_unquantized_linear_weight_is_named_the_rules_own_too() -> None:
    """A list given replaces the loader's default (the head alone): routers and the head are in it."""
    assert modules_not_converted([*HEAD, *_layer(0, True)]) == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
    ]


def test_excluded_experts_are_named_at_the_highest_module_holding_no_quantized_weight() -> None:
    tensors = [*HEAD, *_layer(1, False), *_layer(11, True)]
    assert modules_not_converted(tensors) == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.1.mlp",  # its router and experts (layer 1, not 11)
        "model.layers.11.mlp.gate",
    ]


def test_a_whole_layer_kept_is_one_name() -> None:
    kept = ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")
    tensors = [*HEAD, *_layer(0, True), *((f"model.layers.1.{m}.weight", B, (4, 4)) for m in kept)]
    assert "model.layers.1" in modules_not_converted(tensors)


def test_nothing_quantized_names_nothing() -> None:
    assert modules_not_converted([*HEAD, ("model.layers.0.mlp.up_proj.weight", B, (4, 4))]) == []


def test_the_load_dtype_is_the_floats_one_dtype() -> None:
    assert load_dtype([*HEAD, *_layer(0, True)]) == B  # FP8 weights and their F32 scales aside
    assert load_dtype([*HEAD, ("x.weight", F, (2, 2))]) is None
    assert load_dtype([("x_blocks", UINT8, (2, 2))]) is None


CONFIG = {"model_type": "tiny", "torch_dtype": "float32", "quantization_config": {"quant_method": "mxfp4"}}


def test_a_carried_quantization_config_is_kept_and_a_copy_unchanged_is_the_same_bytes() -> None:
    raw = json.dumps(CONFIG).encode()
    assert rewritten(raw, [*HEAD, ("x_blocks", UINT8, (2, 2))]) is raw
    assert rewritten(raw, [("x.weight", F, (2, 2))], cast=True) is raw  # already float32


def test_dequantized_quantized_and_cast_configs() -> None:
    raw = json.dumps(CONFIG).encode()
    deq = json.loads(rewritten(raw, [*HEAD], dequantized=True))
    assert "quantization_config" not in deq and deq["torch_dtype"] == "bfloat16"
    tensors = [*HEAD, *_layer(0, True), *_layer(1, False)]
    q = json.loads(rewritten(raw, tensors, quantized=(128, 128)))
    assert q["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp"],
    }
    nothing = json.loads(rewritten(raw, [*HEAD], quantized=(128, 128)))
    assert "quantization_config" not in nothing
    cast = json.loads(rewritten(json.dumps({"dtype": "float32"}).encode(), HEAD, cast=True))
    assert cast == {"dtype": "bfloat16"}
    assert rewritten(b"[1, 2]", HEAD, cast=True) == b"[1, 2]"


LOAD = """
from safetensors.torch import load_file
from transformers.quantizers import quantizer_finegrained_fp8 as fp8
fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None  # no GPU: loading is enough
model, info = transformers.AutoModelForCausalLM.from_pretrained(
    ARGS["q"], dtype=torch.bfloat16, output_loading_info=True)
state = model.state_dict()
source = load_file(os.path.join(ARGS["src"], "model.safetensors"))
kept = [k for k in source if ".experts." in k]
out({
    "missing": sorted(info["missing_keys"]),
    "unexpected": sorted(info["unexpected_keys"]),
    "expert_scales": sorted(k for k in state if ".experts." in k and "scale" in k),
    "kept": len(kept),
})
"""


@pytest.mark.parametrize("exclude", ["*.experts.*", "*"])
def test_transformers_loads_a_quantized_model_with_weights_excluded(hf, tmp_path: Path, exclude: str) -> None:
    """With the experts excluded, the config names them (transformers made FP8 layers of them and reported their
    scales missing before); with everything excluded, it has no quantization_config (it looked for scales)."""
    from tests.hf import make_models
    from tests.test_presets_models import DEEPSEEK

    config = {**DEEPSEEK, "hidden_size": 256, "intermediate_size": 384}
    (src,) = make_models(hf, {"ds": ("deepseek_v3", config)}, tmp_path).values()
    q = tmp_path / "q"
    proc = run_cli(
        "transform", "--src", str(src), "--dst", str(q), "--hf", "--quantize", "fp8-block", "--dtype", "bf16",
        "--quantize-exclude", exclude, "--hf-config", str(src / "config.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = json.loads((q / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert ("quantization_config" in config) == (exclude != "*")
    loaded = hf(LOAD, {"q": str(q), "src": str(src)})
    assert loaded["missing"] == [] and loaded["unexpected"] == []
    assert loaded["expert_scales"] == [] and loaded["kept"] > 0
