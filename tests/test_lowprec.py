"""Block-scaled low precision (docs/low-precision.md): the dtype table, and ``--dequantize`` on every writing command.

The dequantized values are checked bit for bit against the CPU references run in the transformers
venv on the very files the test made: torch's ``QuantizedHuggingFaceStorageReader`` (FP8 blocks, edge
blocks partial, F32 and BF16 scales) and transformers' ``convert_moe_packed_tensors`` (MXFP4). The one
documented difference: a NaN weight written as bf16 is numpy's quiet NaN (0x7FC0), torch writes 0xFFFF.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reshard import api, dtypes
from reshard.execute import blockquant, dequant
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.plan.quantized import Precision, parse_block
from tests.lowprec_fixtures import (
    BF16_Q,
    EXPERTS,
    LOAD_FP8,
    NORM,
    NOT_Q,
    QUANTIZE_RULE,
    REFERENCES,
    K,
    Q,
    bf16_model,
    fp8_model,
    fp8_tensors,
)
from tests.trust_helpers import run_cli

TARGETS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with read_safetensors(str(path)) as index:
        return {n: index.array(n).copy() for n in index.entries}


def _same_bits(a: np.ndarray, b: np.ndarray, nan_free: bool = False) -> None:
    """Equal bit for bit; with ``nan_free`` NaNs need only be NaN on both sides (bf16's NaN pattern)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    bits = np.dtype(f"u{a.dtype.itemsize}")
    if nan_free:
        a_nan, b_nan = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        assert (a_nan == b_nan).all()
        assert (a.view(bits)[~a_nan] == b.view(bits)[~b_nan]).all()
    else:
        assert (a.view(bits) == b.view(bits)).all()


# ------------------------------------------------------------------------------------------ the table


def test_low_precision_table() -> None:
    table = dtypes.LOW_PRECISION
    assert [
        (n, lp.storage.st_code, lp.storage.itemsize, lp.values_per_item, lp.in_ckpt) for n, lp in table.items()
    ] == [
        ("F8_E4M3", "F8_E4M3", 1, 1, True),
        ("F8_E5M2", "F8_E5M2", 1, 1, True),
        ("F8_E8M0", "F8_E8M0", 1, 1, False),
        ("MXFP4", "U8", 1, 2, True),
    ]
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # ml_dtypes' E2M1
    assert np.array_equal(np.array(dtypes.FP4_E2M1_VALUES, dtype=np.float32).view(np.uint32), e2m1.view(np.uint32))
    assert float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) == dtypes.FP8_E4M3_LARGEST


def test_e8m0_into_ckpt_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    src = tmp_path / "scales.safetensors"
    save_safetensors(src, {"w.weight_scale": np.arange(6, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)})
    proc = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckpt")
    assert proc.returncode == 2, proc.stderr
    assert "w.weight_scale" in proc.stderr and "F8_E8M0" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.ckpt"))


# ------------------------------------------------------------------------------------------ dequantize


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_model(tmp_path_factory.mktemp("lowprec") / "fp8")


@pytest.fixture(scope="module")
def small_exponents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MXFP4 scales that stay inside float16's range, for the fp16 comparison."""
    return fp8_model(tmp_path_factory.mktemp("lowprec") / "fp8_fp16", fp8_tensors(mxfp4_exponents=(118, 130)))


@pytest.mark.parametrize("target", list(TARGETS))
def test_dequantize_matches_the_references(hf, model: Path, small_exponents: Path, tmp_path: Path, target: str) -> None:
    src = small_exponents if target == "fp16" else model
    ref = tmp_path / "ref.safetensors"
    made = hf(REFERENCES, {"src": str(src), "out": str(ref), "dtype": TARGETS[target]})
    assert made["tensors"] == sorted([Q, K, EXPERTS])
    out = tmp_path / "out"
    proc = run_cli("transform", "--src", str(src), "--dst", str(out), "--hf", "--dequantize", target)
    assert proc.returncode == 0, proc.stderr
    assert "2 FP8 block pair(s), 1 MXFP4 pair(s)" in proc.stderr
    got, want = _arrays(out / "model.safetensors"), _arrays(ref)
    assert sorted(got) == sorted([Q, K, EXPERTS, NORM])  # scales consumed, the norm as it was
    for name in want:
        _same_bits(got[name], want[name], nan_free=target == "bf16")
    assert got[EXPERTS].shape == (2, 96, 6)  # transformers' layout: [experts, 2 * intermediate, hidden]
    _same_bits(got[NORM], fp8_tensors()[NORM])


def test_dequantize_rule_without_torch(model: Path, tmp_path: Path) -> None:
    """The rule spelled out in numpy (float32 multiply per block, edge blocks partial, then fp32 as is)."""
    out = tmp_path / "out"
    api.transform(
        str(model), str(out), output=api.OutputSpec(format="hf"), tensors=api.TensorOptions(precision=Precision("fp32"))
    )
    got = _arrays(out / "model.safetensors")
    t = fp8_tensors()
    w = t[Q].astype(np.float32)
    s = np.repeat(np.repeat(t[Q + "_scale_inv"], 128, 0), 128, 1)[:300, :260]
    finite = np.isfinite(w)
    assert (got[Q][finite] == (w * s)[finite]).all()
    blocks, exps = t[EXPERTS + "_blocks"], t[EXPERTS + "_scales"].astype(np.int32) - 127
    lut = np.array(dtypes.FP4_E2M1_VALUES, dtype=np.float32)
    vals = np.stack([lut[blocks & 15], lut[blocks >> 4]], -1).reshape(2, 6, 3, 32) * np.exp2(exps)[..., None]
    assert (got[EXPERTS] == vals.reshape(2, 6, 96).transpose(0, 2, 1)).all()


def test_dequantize_streams_row_blocks(model: Path, tmp_path: Path) -> None:
    """A tiny --max-memory cuts every tensor into row blocks (boxes across block edges): same bytes."""
    whole, rows = tmp_path / "whole", tmp_path / "rows"
    for out, extra in ((whole, []), (rows, ["--max-memory", "4KiB", "--workers", "1"])):
        proc = run_cli("transform", "--src", str(model), "--dst", str(out), "--hf", "--dequantize", "bf16", *extra)
        assert proc.returncode == 0, proc.stderr
    assert (whole / "model.safetensors").read_bytes() == (rows / "model.safetensors").read_bytes()


def test_dequantize_split_to_ranks_slices_exactly(model: Path, tmp_path: Path) -> None:
    """split to 2 ranks (rows cut at 150 and 65, inside a block): each rank holds its rows of the full result."""
    full, ranks = tmp_path / "full", tmp_path / "ranks"
    api.transform(
        str(model),
        str(full),
        output=api.OutputSpec(format="hf"),
        tensors=api.TensorOptions(precision=Precision("bf16")),
    )
    strategy = tmp_path / "s2.ckpt"
    layouts = {Q: ParamLayout((2,), (0, -1)), K: ParamLayout((2,), (0, -1))}
    write_strategy(strategy, make_strategy(layouts))
    api.split(str(model), str(strategy), str(ranks), tensors=api.TensorOptions(precision=Precision("bf16")))
    whole = _arrays(full / "model.safetensors")
    for r in range(2):
        (part,) = (ranks / f"rank_{r}").glob("*.safetensors")
        got = _arrays(part)
        for name in (Q, K):
            rows = whole[name].shape[0] // 2
            _same_bits(got[name], whole[name][r * rows : (r + 1) * rows], nan_free=True)
        assert sorted(got) == sorted([Q, K])  # the strategy's tensors, no scale


def test_dequantize_hf_config_loses_quantization_config(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = model / "config.json"
    proc = run_cli(
        "transform", "--src", str(model), "--dst", str(out), "--hf", "--hf-config", str(config), "--dequantize", "bf16"
    )
    assert proc.returncode == 0, proc.stderr
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "tiny"


def test_block_size_flag_replaces_the_config(tmp_path: Path) -> None:
    src = fp8_model(tmp_path / "noblock", block=None)
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(src), "--dst", str(out), "--hf", "--dequantize", "fp32", "--block-size", "128"
    )
    assert proc.returncode == 0, proc.stderr
    assert parse_block("128") == parse_block("128x128") == (128, 128)


def test_dry_run_refuses_a_nan_scale_before_any_byte(tmp_path: Path) -> None:
    t = fp8_tensors()
    t[K + "_scale_inv"] = t[K + "_scale_inv"].copy()
    t[K + "_scale_inv"][1, 0] = np.inf
    src = fp8_model(tmp_path / "nan", t)
    with pytest.raises(Exception, match="NaN or infinite"):
        api.transform(
            str(src),
            str(tmp_path / "out"),
            output=api.OutputSpec(format="hf"),
            destination=api.Destination(dry_run=True),
            tensors=api.TensorOptions(precision=Precision("bf16")),
        )


def test_viewed_dequantized_boxes_equal_the_reshaped_tensor(model: Path) -> None:
    """Model maps read through C-order views: a viewed box is the box of the reshaped full tensor."""
    from reshard.plan.model import QuantizedSource

    t = fp8_tensors()
    q = QuantizedSource("x", Q, "fp8-block", Q, "x", Q + "_scale_inv", (128, 128))
    d = dequant.Dequantized(q, t[Q].view(np.uint8), t[Q + "_scale_inv"], (300, 260), "F8_E4M3")
    full = d[(slice(0, 300), slice(0, 260))]
    view = d.reshape((300 * 260 // 100, 100))
    box = (slice(7, 311), slice(13, 77))
    got, want = view[box], np.ascontiguousarray(full).reshape(780, 100)[box]
    assert np.array_equal(got, want, equal_nan=True)


def test_verify_dequantize_compares_a_quantized_source_with_its_export(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("transform", "--src", str(model), "--dst", str(out), "--hf", "--dequantize", "bf16").returncode == 0
    same = run_cli("verify", str(model), str(out), "--dequantize", "bf16")
    assert same.returncode == 0 and "SAME: 4 match" in same.stdout, same.stdout + same.stderr
    other = run_cli("verify", str(model), str(out), "--dequantize", "fp32")
    assert other.returncode == 1, other.stdout + other.stderr  # bf16 written, fp32 read: they differ


def test_convert_one_file_dequantizes_into_ckpt(model: Path, tmp_path: Path) -> None:
    """convert works file by file: a pair inside the file is dequantized; .ckpt holds the bf16 result."""
    out = tmp_path / "out"
    proc = run_cli("convert", str(model / "model.safetensors"), str(out), "--to", "ckpt", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr
    (ckpt_file,) = out.glob("*.ckpt")
    back = tmp_path / "back"
    assert run_cli("convert", str(ckpt_file), str(back), "--to", "safetensors").returncode == 0
    (st,) = back.glob("*.safetensors")
    ref = tmp_path / "ref"
    api.transform(
        str(model), str(ref), output=api.OutputSpec(format="hf"), tensors=api.TensorOptions(precision=Precision("bf16"))
    )
    got, want = _arrays(st), _arrays(ref / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        _same_bits(got[name], want[name])


def test_sharded_sources_are_refused_naming_the_pair(tmp_path: Path) -> None:
    """Two rank files each holding a slice of a pair: a rank alone cannot tell whether its cut is on a block edge."""
    t = fp8_tensors()
    for r in range(2):
        folder = tmp_path / "ranks" / f"rank_{r}"
        folder.mkdir(parents=True)
        save_safetensors(
            folder / f"checkpoint_{r}.safetensors",
            {K: t[K][r * 65 : (r + 1) * 65], K + "_scale_inv": t[K + "_scale_inv"][r : r + 1]},
        )
    strategy = tmp_path / "s2.ckpt"
    write_strategy(
        strategy, make_strategy({K: ParamLayout((2,), (0, -1)), K + "_scale_inv": ParamLayout((2,), (0, -1))})
    )
    proc = run_cli(
        "unify",
        str(tmp_path / "ranks"),
        str(tmp_path / "out"),
        "--src-strategy",
        str(strategy),
        "--dequantize",
        "bf16",
        "--block-size",
        "128",
    )
    assert proc.returncode == 2 and K in proc.stderr and "merge the ranks first" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ quantize


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bf16_model(tmp_path_factory.mktemp("lowprec") / "bf16")


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_quantize_matches_deepseeks_rule_in_torch(hf, bf16: Path, tmp_path: Path, block: tuple[int, int]) -> None:
    out = tmp_path / "out"
    size = f"{block[0]}x{block[1]}"
    proc = run_cli(
        "transform", "--src", str(bf16), "--dst", str(out), "--hf", "--quantize", "fp8-block", "--block-size", size,
        "--hf-config", str(bf16 / "config.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = hf(QUANTIZE_RULE, {"src": str(bf16), "out": str(out), "name": BF16_Q, "block": list(block)})
    assert got == {"values": True, "scales": True, "dtypes": ["torch.float8_e4m3fn", "torch.float32"]}
    written = _arrays(out / "model.safetensors")
    assert sorted(written) == sorted([*NOT_Q, BF16_Q, BF16_Q + "_scale_inv"])
    source = _arrays(bf16 / "model.safetensors")
    for name in NOT_Q:  # the rule leaves embeddings, routers, norms and the head alone
        _same_bits(written[name], source[name])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.mlp"],  # the router's module
    }  # fmt: skip


def test_quantize_streams_row_blocks(bf16: Path, tmp_path: Path) -> None:
    whole, rows = tmp_path / "whole", tmp_path / "rows"
    for out, extra in ((whole, []), (rows, ["--max-memory", "4KiB", "--workers", "1"])):
        proc = run_cli("transform", "--src", str(bf16), "--dst", str(out), "--hf", "--quantize", "fp8-block", *extra)
        assert proc.returncode == 0, proc.stderr
    assert (whole / "model.safetensors").read_bytes() == (rows / "model.safetensors").read_bytes()


def test_quantize_shares_scales_between_passes_or_not(
    bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight's scales handed from its first pass to its second (``ScaleMemo``), or recomputed when the memo is
    full, on one thread or two: the same bytes."""
    from reshard.execute.local import RunOptions

    outs, computed = [], []
    scale_of = dequant.Quantized._scale_of

    def counted(self: dequant.Quantized, *args: object) -> np.ndarray:
        computed[-1] += 1
        return scale_of(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(dequant.Quantized, "_scale_of", counted)
    for memo, workers in ((blockquant.MEMO_BYTES, 1), (blockquant.MEMO_BYTES, 2), (0, 2)):
        monkeypatch.setattr(blockquant, "MEMO_BYTES", memo)
        out = tmp_path / f"q{len(outs)}"
        computed.append(0)
        run = RunOptions(workers=workers, max_memory=64 * 1024)
        api.transform(
            str(bf16),
            str(out),
            run=run,
            output=api.OutputSpec(format="hf"),
            tensors=api.TensorOptions(precision=Precision(quantize="fp8-block")),
        )
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1] == outs[2]
    assert computed[0] < computed[2]  # the memo spared the second pass


def test_quantize_rule_and_its_overrides(bf16: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    precision = Precision(quantize="fp8-block", quantize_include=("lm_head.weight",), quantize_exclude=(BF16_Q,))
    api.transform(
        str(bf16), str(out), output=api.OutputSpec(format="hf"), tensors=api.TensorOptions(precision=precision)
    )
    written = _arrays(out / "model.safetensors")
    assert written["lm_head.weight"].dtype == ml_dtypes.float8_e4m3fn and "lm_head.weight_scale_inv" in written
    assert written[BF16_Q].dtype == ml_dtypes.bfloat16 and BF16_Q + "_scale_inv" not in written


def test_an_include_naming_what_cannot_be_quantized_is_said(bf16: Path, tmp_path: Path) -> None:
    """A 1-D norm named by --quantize-include stays as it is, and the note says so (it was silent)."""
    proc = run_cli(
        "transform", "--src", str(bf16), "--dst", str(tmp_path / "out"), "--hf", "--quantize", "fp8-block",
        "--quantize-include", "model.norm.weight",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--quantize-include matched 1 tensor(s) not 2-D floats, left as they are" in proc.stderr
    assert "model.norm.weight_scale_inv" not in _arrays(tmp_path / "out" / "model.safetensors")


def test_quantize_then_dequantize_round_trips_within_fp8(bf16: Path, tmp_path: Path) -> None:
    q, back = tmp_path / "q", tmp_path / "back"
    api.transform(
        str(bf16),
        str(q),
        output=api.OutputSpec(format="hf"),
        tensors=api.TensorOptions(precision=Precision(quantize="fp8-block")),
    )
    (q / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128, 128]}}))
    api.transform(
        str(q), str(back), output=api.OutputSpec(format="hf"), tensors=api.TensorOptions(precision=Precision("fp32"))
    )
    source = _arrays(bf16 / "model.safetensors")[BF16_Q].astype(np.float32)
    again = _arrays(back / "model.safetensors")[BF16_Q]
    assert again[:128, 128:256].max() == 0 and again[5, 7] == 40.0
    mask = np.abs(source) > 1e-2  # away from the scale's flush region: E4M3's 3 mantissa bits
    assert np.allclose(again[mask], source[mask], rtol=2**-4)


def test_quantized_output_loads_in_transformers(hf, tmp_path: Path) -> None:
    """transformers' FineGrainedFP8Config(dequantize=True) reads reshard's FP8 blocks as reshard --dequantize does;
    written as Hugging Face shards, whose index names every weight's and scale's shard, and read back from them."""
    from tests.hf import make_models

    (src,) = make_models(hf, {"llama": ("llama", {"hidden_size": 256, "intermediate_size": 384})}, tmp_path).values()
    q, deq = tmp_path / "q", tmp_path / "deq"
    proc = run_cli(
        "transform", "--src", str(src), "--dst", str(q), "--hf", "--quantize", "fp8-block", "--dtype", "bf16",
        "--hf-config", str(src / "config.json"), "--max-shard-size", "300KB",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    weight_map = json.loads((q / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [n for n in weight_map if n.endswith("_scale_inv")]
    assert len(set(weight_map.values())) > 2 and scales and all(n[: -len("_scale_inv")] in weight_map for n in scales)
    proc = run_cli("transform", "--src", str(q), "--dst", str(deq), "--hf", "--dequantize", "bf16")
    assert proc.returncode == 0, proc.stderr
    loaded = hf(LOAD_FP8, {"quantized": str(q), "dequantized": str(deq)})
    assert loaded["differ"] == [] and loaded["compared"] > 10


def test_preset_deepseek_v3_sees_through_fp8_blocks(hf, tmp_path: Path) -> None:
    """An FP8 DeepSeek-V3 release to MindFormers names in one command: --preset deepseek-v3 --dequantize bf16
    writes the bytes the preset writes from the dequantized model (stacked experts included), and with
    --dst-strategy the per-rank shards of that model in the same one command."""
    from tests.hf import make_models
    from tests.test_presets_models import DEEPSEEK

    config = {**DEEPSEEK, "hidden_size": 256, "intermediate_size": 384}
    (src,) = make_models(hf, {"ds": ("deepseek_v3", config)}, tmp_path).values()
    fp8, deq, direct, via = (tmp_path / n for n in ("fp8", "deq", "direct", "via"))
    steps = [
        (
            "--src",
            src,
            "--dst",
            fp8,
            "--hf",
            "--quantize",
            "fp8-block",
            "--dtype",
            "bf16",
            "--hf-config",
            src / "config.json",
        ),
        ("--src", fp8, "--dst", deq, "--hf", "--dequantize", "bf16"),
        (
            "--src",
            fp8,
            "--dst",
            direct,
            "--preset",
            "deepseek-v3",
            "--dequantize",
            "bf16",
            "--hf-config",
            fp8 / "config.json",
        ),
        ("--src", deq, "--dst", via, "--preset", "deepseek-v3", "--hf-config", src / "config.json"),
    ]
    for step in steps:
        proc = run_cli("transform", *map(str, step), "--output_format", "safetensors")
        assert proc.returncode == 0, proc.stderr
    assert "weight_scale_inv" in " ".join(_arrays(fp8 / "model.safetensors"))
    (a,), (b,) = (direct / "rank_0").glob("*.safetensors"), (via / "rank_0").glob("*.safetensors")
    assert a.read_bytes() == b.read_bytes()
    # per-rank shards in the same one command: the bytes of splitting the MindFormers model by the strategy
    strategy = _two_rank_rows(_arrays(a), tmp_path / "s2.ckpt")
    ranks, cut = tmp_path / "ranks", tmp_path / "cut"
    args = ("--src", fp8, "--dst", ranks, "--preset", "deepseek-v3", "--dequantize", "bf16", "--dst-strategy", strategy)
    proc = run_cli(
        "transform", *map(str, args), "--hf-config", str(fp8 / "config.json"), "--output_format", "safetensors"
    )
    assert proc.returncode == 0, proc.stderr
    api.split(str(a), str(strategy), str(cut), output=api.OutputSpec(format="safetensors"))
    full = _arrays(a)
    for r in (0, 1):
        (got,), (want,) = (ranks / f"rank_{r}").glob("*.safetensors"), (cut / f"rank_{r}").glob("*.safetensors")
        mine, theirs = _arrays(got), _arrays(want)  # split writes the strategy's tensors; transform all of them
        assert sorted(mine) == sorted(full) and set(theirs) <= set(mine)
        for n, x in mine.items():
            assert x.view(np.uint8).tobytes() == theirs.get(n, full[n]).view(np.uint8).tobytes(), (r, n)


def _two_rank_rows(tensors: dict[str, np.ndarray], path: Path) -> Path:
    """A 2-rank strategy cutting dim 0 of every tensor of two or more dimensions whose dim 0 is even."""
    layouts = {
        n: ParamLayout((2,), (0, *[-1] * (v.ndim - 1)))
        for n, v in tensors.items()
        if v.ndim >= 2 and v.shape[0] % 2 == 0
    }
    write_strategy(path, make_strategy(layouts))
    return path


def test_preset_deepseek_v3_exports_mindformers_bf16_to_fp8_blocks_in_one_command(hf, tmp_path: Path) -> None:
    """The reverse of the test above: --hf --preset deepseek-v3 --quantize fp8-block quantizes the preset's
    Hugging Face tensors (each routed expert unstacked, then quantized), the bytes of exporting then quantizing."""
    from tests.hf import make_models
    from tests.test_presets_models import DEEPSEEK

    config = {**DEEPSEEK, "hidden_size": 256, "intermediate_size": 384}
    (src,) = make_models(hf, {"ds": ("deepseek_v3", config)}, tmp_path).values()
    mf, one, bf16, two = (tmp_path / n for n in ("mf", "one", "bf16", "two"))
    hf_config = ("--hf-config", str(src / "config.json"))
    steps = [
        ("--src", src, "--dst", mf, "--preset", "deepseek-v3", *hf_config, "--output_format", "safetensors"),
        ("--src", mf, "--dst", one, "--hf", "--preset", "deepseek-v3", "--quantize", "fp8-block", *hf_config),
        ("--src", mf, "--dst", bf16, "--hf", "--preset", "deepseek-v3", *hf_config),
        ("--src", bf16, "--dst", two, "--hf", "--quantize", "fp8-block", "--hf-config", str(bf16 / "config.json")),
    ]
    for step in steps:
        proc = run_cli("transform", *map(str, step))
        assert proc.returncode == 0, proc.stderr
    got = _arrays(one / "model.safetensors")
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert got[expert].dtype == ml_dtypes.float8_e4m3fn and expert + "_scale_inv" in got
    assert "model.embed_tokens.weight_scale_inv" not in got  # the rule on Hugging Face names: embeddings stay
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    assert json.loads((one / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_quantize_with_a_map_and_a_destination_strategy_is_refused(bf16: Path, tmp_path: Path) -> None:
    from reshard.errors import UnsupportedError
    from reshard.naming import NameOptions
    from reshard.naming.presets import FROM_HF, preset_map

    strategy = tmp_path / "s2.ckpt"
    write_strategy(strategy, make_strategy({"lm_head.weight": ParamLayout((2,), (0, -1))}))
    names = NameOptions(model_map=preset_map("llama", direction=FROM_HF))
    with pytest.raises(UnsupportedError, match="writes a full model"):
        api.transform(
            str(bf16),
            str(tmp_path / "o"),
            None,
            str(strategy),
            destination=api.Destination(dry_run=True),
            tensors=api.TensorOptions(names=names, precision=Precision(quantize="fp8-block")),
        )


def test_plan_json_states_the_pairs_before_writing(model: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "plan", "--src", str(model), "--dst", str(tmp_path / "out"), "--hf", "--dequantize", "bf16", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    kinds = {q["tensor"]: (q["kind"], q["scale"], q["block"]) for q in doc["quantized"]}
    assert kinds == {
        Q: ("fp8-block", Q + "_scale_inv", [128, 128]),
        K: ("fp8-block", K + "_scale_inv", [128, 128]),
        EXPERTS: ("mxfp4", EXPERTS + "_scales", [32]),
    }
    assert not (tmp_path / "out").exists()


def test_mindformers_tool_flags_refuse_dequantize(model: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "transform", "--src_checkpoint", str(model), "--dst_checkpoint_dir", str(tmp_path / "o"), "--dequantize", "bf16"
    )
    assert proc.returncode == 2 and "--dequantize does not combine" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "change"), [("--quantize", "fp8-block", "adds"), ("--dequantize", "bf16", "drops")]
)
def test_without_hf_config_the_note_names_the_sources_config(
    tmp_path: Path, flag: str, value: str, change: str
) -> None:
    """No config.json is invented; the note gives the flag that copies the source's own, and what it becomes."""
    src = bf16_model(tmp_path / "bf16") if flag == "--quantize" else fp8_model(tmp_path / "fp8")
    out = tmp_path / "out"
    proc = run_cli("transform", "--src", str(src), "--dst", str(out), "--hf", flag, value)
    assert proc.returncode == 0, proc.stderr
    assert not (out / "config.json").exists()
    assert (
        f"give --hf-config {src / 'config.json'} to copy it in; {flag} {change} its quantization_config" in proc.stderr
    )
    again = run_cli(
        "transform",
        "--src",
        str(src),
        "--dst",
        str(tmp_path / "with"),
        "--hf",
        flag,
        value,
        "--hf-config",
        str(src / "config.json"),
    )
    assert again.returncode == 0 and "no config.json" not in again.stderr
    has = "quantization_config" in json.loads((tmp_path / "with" / "config.json").read_text())
    assert has == (flag == "--quantize")
