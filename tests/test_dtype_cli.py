"""``--dtype`` / ``--dtype-all`` on every writing command, through the CLI on ``reshard demo``'s files.

The demo's model is Float32 with AdamW moments (``adam_m.``/``adam_v.``), an Int32 ``global_step``
and a 0-d Float32 ``learning_rate``. Every output is read back and held against the full model
cast with numpy's ``astype``: model weights cast, training state and scalars as they were (all of
it with ``--dtype-all``, but never integers or 0-d entries). An overflow is one line, exit 2, and
a destination holding nothing.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard import api, statenames
from reshard.errors import UsageError
from reshard.execute.options import RunOptions
from reshard.formats.ckpt import save_ckpt
from reshard.sources import open_checkpoint
from tests.trust_helpers import run_cli

NP = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
MS = {"bf16": "BFloat16", "fp16": "Float16", "fp32": "Float32"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    from reshard import demo as demo_mod

    folder = str(tmp_path_factory.mktemp("demo") / "demo")
    demo_mod.main(folder)
    return folder


@pytest.fixture(scope="module")
def model(demo: str) -> dict[str, np.ndarray]:
    with open_checkpoint(os.path.join(demo, "full", "model.ckpt")) as index:
        return {name: np.array(index.array(name)) for name, e in index.entries.items() if not e.is_string}


def _read_all(root: str, pattern: str = "**/*.*") -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, array) of every tensor in the checkpoint files under ``root`` (first holder wins)."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
        if not path.endswith((".ckpt", ".safetensors")):
            continue
        with open_checkpoint(path) as index:
            for name, e in index.entries.items():
                if not e.is_string:
                    out.setdefault(name, (e.dtype.ms_name, np.array(index.array(name))))
    return out


def _expected_dtype(name: str, array: np.ndarray, dtype: str, everything: bool) -> str:
    floating = array.dtype.kind == "f" and array.ndim > 0
    if not floating or (statenames.DEFAULT.is_state(name) and not everything):
        return {np.dtype(np.float32): "Float32", np.dtype(np.int32): "Int32"}[array.dtype]
    return MS[dtype]


def _check_full(out: dict[str, tuple[str, np.ndarray]], model: dict[str, np.ndarray], dtype: str, everything: bool):
    """Full tensors: each the model's value cast (bit for bit) or kept, as the rules say."""
    assert set(out) == set(model)
    for name, ref in model.items():
        got_dtype, got = out[name]
        want = _expected_dtype(name, ref, dtype, everything)
        assert got_dtype == want, name
        expected = ref.astype(NP[dtype]) if want == MS[dtype] and ref.dtype.kind == "f" else ref
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), name


def _one_line_error(result: Any, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ------------------------------------------------------------------------------ every writing command


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("everything", [False, True], ids=["weights", "dtype-all"])
def test_transform_to_full_casts_weights_and_keeps_the_rest(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any, dtype: str, everything: bool
) -> None:
    dst = str(tmp_path / "full")
    extra = ["--dtype-all"] if everything else []
    r = run_cli(
        "transform",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst",
        dst,
        "--dtype",
        dtype,
        *extra,
    )
    assert r.returncode == 0, r.stderr
    assert f"tensor(s) cast to {MS[dtype]}" in r.stderr
    assert ("training-state" in r.stderr) is not everything
    _check_full(_read_all(dst), model, dtype, everything)


def test_transform_ranks_to_ranks_then_back_to_full(demo: str, model: dict[str, np.ndarray], tmp_path: Any) -> None:
    """8 -> 4 ranks (strided boxes, row splits, optimizer shards) in bf16; a plain transform of that
    to full gives the cast model; verify --dtype bf16 says SAME, verify without it names the dtype."""
    four, full = str(tmp_path / "four"), str(tmp_path / "full")
    r = run_cli(
        "transform",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst-strategy",
        f"{demo}/strategy_4",
        "--dst",
        four,
        "--dtype",
        "bf16",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("transform", "--src", four, "--src-strategy", f"{demo}/strategy_4", "--dst", full)
    assert r.returncode == 0, r.stderr
    _check_full(_read_all(full), model, "bf16", False)
    same = run_cli(
        "verify",
        f"{demo}/ckpt_8ranks",
        four,
        "--a-strategy",
        f"{demo}/strategy_8",
        "--b-strategy",
        f"{demo}/strategy_4",
        "--dtype",
        "bf16",
    )
    assert same.returncode == 0, same.stdout + same.stderr
    assert "SAME: 119 match" in same.stdout
    differ = run_cli(
        "verify",
        f"{demo}/ckpt_8ranks",
        four,
        "--a-strategy",
        f"{demo}/strategy_8",
        "--b-strategy",
        f"{demo}/strategy_4",
    )
    assert differ.returncode == 1 and "dtype Float32 vs BFloat16" in differ.stdout


def test_transform_hf_shards_are_sized_and_indexed_in_the_cast_dtype(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any
) -> None:
    dst = str(tmp_path / "hf")
    r = run_cli(
        "transform",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst",
        dst,
        "--hf",
        "--keep-training-state",
        "--max-shard-size",
        "1MB",
        "--dtype",
        "bf16",
    )
    assert r.returncode == 0, r.stderr
    with open(os.path.join(dst, "model.safetensors.index.json"), encoding="utf-8") as fh:
        index = json.load(fh)
    out = _read_all(dst)
    _check_full(out, model, "bf16", False)
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in out.values())
    shards = sorted(glob.glob(os.path.join(dst, "model-*.safetensors")))
    assert len(shards) > 1 and all(os.path.getsize(p) <= 1_000_000 + 64 * 1024 for p in shards)
    for name, shard in index["weight_map"].items():
        with open_checkpoint(os.path.join(dst, shard)) as ix:
            assert name in ix.entries
    same = run_cli("verify", f"{demo}/full/model.ckpt", dst, "--dtype", "bf16")
    assert same.returncode == 0 and "SAME: 119 match" in same.stdout, same.stdout + same.stderr
    plain = run_cli("verify", f"{demo}/full/model.ckpt", dst)
    assert plain.returncode == 1 and "39 differ" in plain.stdout
    wrong = run_cli("verify", f"{demo}/full/model.ckpt", dst, "--dtype", "fp16")  # bf16 values read as fp16
    assert wrong.returncode == 1 and "values differ" in wrong.stdout


def test_transform_checkpoint2_metadata_says_the_cast_dtype(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any
) -> None:
    dst = str(tmp_path / "mf2")
    r = run_cli(
        "transform",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst-strategy",
        f"{demo}/strategy_4",
        "--dst",
        dst,
        "--output-format",
        "checkpoint2",
        "--dtype",
        "fp16",
    )
    assert r.returncode == 0, r.stderr
    (metadata,) = glob.glob(os.path.join(dst, "iteration_*", "metadata.json"))
    with open(metadata, encoding="utf-8") as fh:
        text = fh.read()
    assert '"Float16"' in text and '"Float32"' in text  # weights cast, optimizer moments kept
    opt = _read_all(dst, "**/*opt*.safetensors")
    assert opt and all(d == "Float32" for n, (d, _) in opt.items() if n.startswith("adam_"))
    full = str(tmp_path / "full")
    r = run_cli("transform", "--src", dst, "--dst", full)
    assert r.returncode == 0, r.stderr
    _check_full(_read_all(full), model, "fp16", False)


def test_checkpoint2_and_hugging_face_sources_cast(demo: str, model: dict[str, np.ndarray], tmp_path: Any) -> None:
    """A Checkpoint 2.0 source (virtual ranks) to full bf16; that full model as a Hugging Face source
    split to 4 ranks in fp16 (bf16 -> fp16 narrows: checked), back to full in fp32."""
    full, hf, four, back = (str(tmp_path / n) for n in ("full", "hf", "four", "back"))
    r = run_cli("transform", "--src", f"{demo}/mf2_8ranks", "--dst", full, "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    _check_full(_read_all(full), model, "bf16", False)
    r = run_cli(
        "transform",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst",
        hf,
        "--hf",
        "--keep-training-state",
        "--dtype",
        "bf16",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("transform", "--src", hf, "--dst-strategy", f"{demo}/strategy_4", "--dst", four, "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    r = run_cli("transform", "--src", four, "--src-strategy", f"{demo}/strategy_4", "--dst", back, "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    for name, (d, got) in _read_all(back).items():
        ref = model[name]
        cast = ref.dtype.kind == "f" and ref.ndim > 0 and not statenames.DEFAULT.is_state(name)
        expected = ref.astype(ml_dtypes.bfloat16).astype(np.float16).astype(np.float32) if cast else ref
        assert d == ("Float32" if ref.dtype.kind == "f" else "Int32") and got.tobytes() == expected.tobytes(), name


def test_optimizer_prefix_joins_the_training_state_rule(demo: str, tmp_path: Any) -> None:
    """With checkpoint2 output, --optimizer-prefix names go to the opt- files and keep their dtype."""
    report = api.transform(
        f"{demo}/ckpt_8ranks",
        str(tmp_path / "p"),
        f"{demo}/strategy_8",
        f"{demo}/strategy_4",
        output=api.OutputSpec(format="checkpoint2", optimizer_prefixes=["lm_head."]),
        destination=api.Destination(dry_run=True),
        tensors=api.TensorOptions(dtype="bf16"),
    )
    dtype_of = {t.name: t.dtype.ms_name for f in report.plan.files for t in f.tensors}
    assert dtype_of["lm_head.weight"] == "Float32" and dtype_of["model.norm_out.weight"] == "BFloat16"


def test_convert_casts(demo: str, tmp_path: Any) -> None:
    dst = str(tmp_path / "st")
    r = run_cli("convert", f"{demo}/ckpt_8ranks", dst, "--to", "safetensors", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    for rank in range(8):
        src = _read_all(f"{demo}/ckpt_8ranks/rank_{rank}")
        out = _read_all(f"{dst}/rank_{rank}")
        assert set(out) == set(src)
        for name, (d, ref) in src.items():
            cast = d == "Float32" and ref.ndim > 0 and not statenames.DEFAULT.is_state(name)
            expected = ref.astype(ml_dtypes.bfloat16) if cast else ref
            assert out[name][0] == ("BFloat16" if cast else d) and out[name][1].tobytes() == expected.tobytes()


def test_unify_then_split(demo: str, model: dict[str, np.ndarray], tmp_path: Any) -> None:
    """unify casts to bf16 with --dtype-all; split casts that back to fp32 (widening: exact)."""
    unified, ranks, full = str(tmp_path / "unified"), str(tmp_path / "ranks"), str(tmp_path / "full")
    r = run_cli(
        "unify", f"{demo}/st_8ranks", unified, "--src-strategy", f"{demo}/strategy_8", "--dtype", "bf16", "--dtype-all"
    )
    assert r.returncode == 0, r.stderr
    _check_full(_read_all(unified), model, "bf16", True)
    r = run_cli("split", unified, ranks, "--dst-strategy", f"{demo}/strategy_4", "--dtype", "fp32", "--dtype-all")
    assert r.returncode == 0, r.stderr
    r = run_cli("transform", "--src", ranks, "--src-strategy", f"{demo}/strategy_4", "--dst", full)
    assert r.returncode == 0, r.stderr
    back = _read_all(full)
    for name, ref in model.items():
        expected = ref.astype(ml_dtypes.bfloat16).astype(np.float32) if ref.dtype.kind == "f" and ref.ndim else ref
        assert back[name][1].tobytes() == expected.tobytes(), name


def test_plan_shows_the_output_dtypes(demo: str, tmp_path: Any) -> None:
    r = run_cli(
        "plan",
        "--src",
        f"{demo}/ckpt_8ranks",
        "--src-strategy",
        f"{demo}/strategy_8",
        "--dst-strategy",
        f"{demo}/strategy_4",
        "--dst",
        str(tmp_path / "p"),
        "--dtype",
        "bf16",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    dtypes_of = {t["name"]: t["dtype"] for f in plan["files"] for t in f["tensors"]}
    assert dtypes_of["model.layers.0.attention.wq.weight"] == "BFloat16"
    assert dtypes_of["adam_m.model.layers.0.attention.wq.weight"] == "Float32"
    assert dtypes_of["global_step"] == "Int32" and dtypes_of["learning_rate"] == "Float32"
    assert "--dtype: 39 tensor(s) cast to BFloat16" in r.stderr
    assert not os.path.exists(tmp_path / "p")


# ---------------------------------------------------------------------------------------- overflow


def _model_with(model: dict[str, np.ndarray], name: str, value: float) -> dict[str, np.ndarray]:
    changed = dict(model)
    changed[name] = model[name].copy()
    changed[name].reshape(-1)[-1] = value
    return changed


@pytest.mark.parametrize("existing", [False, True], ids=["new-destination", "empty-destination"])
def test_overflow_is_one_line_exit_2_and_nothing_written(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any, existing: bool
) -> None:
    """A value of the last layer overflows float16: the 4 outputs of rank files already written are
    rolled back too; the destination is as it was (absent, or empty)."""
    src = str(tmp_path / "big.ckpt")
    save_ckpt(src, _model_with(model, "model.layers.3.feed_forward.w2.weight", 1e6))
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
    r = run_cli(
        "transform",
        "--src",
        src,
        "--dst-strategy",
        f"{demo}/strategy_4",
        "--dst",
        str(dst),
        "--dtype",
        "fp16",
        "--workers",
        "1",
    )
    _one_line_error(r, "model.layers.3.feed_forward.w2.weight", "Float16", "1e+06", "65504")
    assert os.listdir(dst) == [] if existing else not dst.exists()


def test_overflow_after_finished_outputs_rolls_them_back(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any
) -> None:
    """One worker writes rank 0..3 in order; the bad tensor is in the last pipeline stage, so whole
    outputs were written (bytes reported) before the error, and none of them stays."""
    src = str(tmp_path / "big.ckpt")
    save_ckpt(src, _model_with(model, "lm_head.weight", -7e5))
    written: list[int] = []
    dst = tmp_path / "out"
    with pytest.raises(UsageError, match=r"^lm_head.weight: cast to Float16 overflows: largest magnitude 700000"):
        api.transform(
            src,
            str(dst),
            None,
            f"{demo}/strategy_4",
            run=RunOptions(workers=1, progress=written.append),
            tensors=api.TensorOptions(dtype="fp16"),
        )
    assert sum(written) > 0 and not dst.exists()


def test_overflow_in_a_training_state_tensor_only_with_dtype_all(
    demo: str, model: dict[str, np.ndarray], tmp_path: Any
) -> None:
    src = str(tmp_path / "big.ckpt")
    save_ckpt(src, _model_with(model, "adam_v.model.layers.0.attention.wq.weight", 1e6))
    r = run_cli("transform", "--src", src, "--dst", str(tmp_path / "kept"), "--dtype", "fp16")
    assert r.returncode == 0, r.stderr  # the moments keep Float32 by default
    r = run_cli("convert", src, str(tmp_path / "all"), "--to", "safetensors", "--dtype", "fp16", "--dtype-all")
    _one_line_error(r, "adam_v.model.layers.0.attention.wq.weight", "65504")
    assert not (tmp_path / "all").exists()


def test_source_infinity_is_kept(model: dict[str, np.ndarray], tmp_path: Any) -> None:
    src = str(tmp_path / "inf.ckpt")
    save_ckpt(src, _model_with(model, "lm_head.weight", np.inf))
    r = run_cli("transform", "--src", src, "--dst", str(tmp_path / "out"), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    out = _read_all(str(tmp_path / "out"))
    assert np.isposinf(out["lm_head.weight"][1].reshape(-1)[-1])


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["transform", "--src", "{demo}/full/model.ckpt", "--dst", "{out}", "--dtype", "fp8"], "unknown --dtype"),
        (["transform", "--src", "{demo}/full/model.ckpt", "--dst", "{out}", "--dtype-all"], "--dtype-all needs"),
        (["convert", "{demo}/full/model.ckpt", "{out}", "--to", "safetensors", "--dtype", "int8"], "choose bf16"),
        (
            ["unify", "{demo}/st_8ranks", "{out}", "--src-strategy", "{demo}/strategy_8", "--dtype", "x"],
            "unknown --dtype",
        ),
        (
            ["split", "{demo}/full/model.ckpt", "{out}", "--dst-strategy", "{demo}/strategy_4", "--dtype", "f64"],
            "choose",
        ),
        (["convert", "{demo}/ckpt_8ranks", "{out}", "--to", "ckpt", "--dtype", "bf16"], "to cast a .ckpt"),
        (["verify", "{demo}/full/model.ckpt", "{demo}/full/model.ckpt", "--dtype", "fp64"], "unknown --dtype"),
    ],
)
def test_bad_dtype_input_is_one_line_and_writes_nothing(demo: str, tmp_path: Any, args: list[str], needle: str) -> None:
    out = tmp_path / "out"
    before = sorted(os.listdir(demo))
    r = run_cli(*[a.format(demo=demo, out=out) for a in args])
    _one_line_error(r, needle)
    assert not out.exists() and sorted(os.listdir(demo)) == before


def test_transform_tool_flags_refuse_dtype(demo: str, tmp_path: Any) -> None:
    """MindFormers' --src_checkpoint mode has no --dtype: refused in one line rather than ignored."""
    shutil.copytree(f"{demo}/ckpt_8ranks", tmp_path / "src")
    r = run_cli(
        "transform",
        "--src_checkpoint",
        str(tmp_path / "src"),
        "--dst_checkpoint",
        str(tmp_path / "o"),
        "--dtype",
        "bf16",
    )
    _one_line_error(r, "--dtype does not combine")
