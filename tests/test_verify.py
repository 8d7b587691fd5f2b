"""``reshard verify``: same model in any layout/format matches; every kind of difference is found;
memory stays bounded by the block size; exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reshard import api, verify
from reshard.errors import IntegrityError, UsageError
from reshard.formats.ckpt import read_ckpt, save_ckpt
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.sources import ReadOptions
from reshard.synthetic import full_model
from tests.trust_helpers import SMALL, make_job, run_cli

KEY = bytes(range(16))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("job"))
    job = make_job(root)
    api.transform(job["r8"], f"{root}/r4", job["s8"], job["s4"], output=api.OutputSpec(format="safetensors"))
    api.unify(job["r8st"], job["s8"], f"{root}/unified")
    job["r4"], job["unified"] = f"{root}/r4", f"{root}/unified"
    return job


def _model() -> dict[str, object]:
    return full_model(SMALL)


def _save(path: Path, values: dict[str, object], **kw: object) -> str:
    save_ckpt(path, values, **kw)  # type: ignore[arg-type]
    return str(path)


@pytest.mark.parametrize(
    ("a", "a_strategy", "b", "b_strategy"),
    [
        ("full", None, "r8", "s8"),
        ("r8", "s8", "r8st", "s8dir"),  # .ckpt tree vs safetensors tree, merged vs per-stage strategy
        ("r8", "s8", "r4", "s4"),  # 8 ranks vs the transformed 4 ranks
        ("unified", None, "full", None),  # unified parts + hyper params vs one file
        ("r4", "s4dir", "unified", None),
    ],
)
def test_same_model_in_any_layout_matches(job, a, a_strategy, b, b_strategy) -> None:
    report = verify.verify(job[a], job[b], a_strategy=job.get(a_strategy or ""), b_strategy=job.get(b_strategy or ""))
    assert report.ok, [r for r in report.results if r.status != "match"]
    assert len(report.matching) == len(_model())


def test_differences_missing_unexpected(job, tmp_path) -> None:
    model = _model()
    changed = dict(model)
    w = np.array(model["model.layers.0.attention.wq.weight"])
    w[3, 5] += 0.25
    changed["model.layers.0.attention.wq.weight"] = w
    del changed["model.norm_out.weight"]
    changed["extra.bias"] = np.zeros(3, np.float32)
    changed["lm_head.weight"] = np.zeros((4, 4), np.float32)  # other shape
    changed["global_step"] = np.array([1000], np.int64)  # other dtype, same value
    other = _save(tmp_path / "other.ckpt", changed)
    report = verify.verify(job["r8"], other, a_strategy=job["s8"])
    assert not report.ok
    by_name = {r.name: r for r in report.results}
    wq = by_name["model.layers.0.attention.wq.weight"]
    assert wq.status == "differ" and wq.max_abs_diff == pytest.approx(0.25)
    assert report.missing == ["model.norm_out.weight"]
    assert report.unexpected == ["extra.bias"]
    assert "shape" in by_name["lm_head.weight"].detail
    assert by_name["global_step"].status == "differ" and "dtype" in by_name["global_step"].detail
    assert by_name["global_step"].max_abs_diff == 0
    assert len(report.matching) == len(model) - 4


def test_atol_and_nan(tmp_path) -> None:
    a = _save(tmp_path / "a.ckpt", {"x": np.array([1.0, 2.0, np.nan], np.float32), "n": np.array([np.nan])})
    b = _save(tmp_path / "b.ckpt", {"x": np.array([1.0, 2.0 + 1e-6, np.nan], np.float32), "n": np.array([1.0])})
    exact = verify.verify(a, b)
    assert exact.differing == ["x", "n"]
    loose = {r.name: r for r in verify.verify(a, b, atol=1e-5).results}
    assert loose["x"].status == "match" and "atol" in loose["x"].detail
    assert loose["n"].status == "differ" and loose["n"].max_abs_diff == float("inf")
    with pytest.raises(UsageError, match="atol"):
        verify.verify(a, b, atol=-1)


def test_strings_and_bfloat16_across_formats(tmp_path) -> None:
    values = {"w": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16), "tag": "hello"}
    ck = _save(tmp_path / "m.ckpt", values)
    api.convert(ck, str(tmp_path / "st"), "safetensors")
    st = str(tmp_path / "st" / "m.safetensors")
    assert verify.verify(ck, st).ok
    other = _save(tmp_path / "o.ckpt", {**values, "tag": "world"})
    assert verify.verify(ck, other).differing == ["tag"]


def test_tiny_blocks_and_bounded_memory(tmp_path) -> None:
    """A 8 MiB tensor split by columns over 4 ranks is compared in blocks of ~max_memory."""
    full = np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)
    path = _save(tmp_path / "full.ckpt", {"w": full})
    sf = make_strategy({"w": ParamLayout((4,), (-1, 0))})
    write_strategy(tmp_path / "s.ckpt", sf)
    for r in range(4):
        shard = np.ascontiguousarray(full[:, r * 256 : (r + 1) * 256])
        _save(tmp_path / "ranks" / f"rank_{r}" / "c.ckpt", {"w": shard})
    tracemalloc.start()
    try:
        report = verify.verify(
            path, str(tmp_path / "ranks"), b_strategy=str(tmp_path / "s.ckpt"), max_memory=512 * 1024
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok
    assert peak < 1024 * 1024, peak  # the tensor is 8 MiB; blocks are 512 KiB / 32 per element
    tiny = verify.verify(path, str(tmp_path / "ranks"), b_strategy=str(tmp_path / "s.ckpt"), max_memory=1)
    assert tiny.ok  # one row per block


def test_crc_trailers_checked_by_default(tmp_path) -> None:
    values = {"w": np.arange(64, dtype=np.float32)}
    good = _save(tmp_path / "good.ckpt", values, write_crc=True)
    bad = tmp_path / "bad.ckpt"
    data = bytearray(Path(good).read_bytes())
    data[-40] ^= 0x01  # inside the last tensor's bytes, before the trailer
    bad.write_bytes(bytes(data))
    report = verify.verify(good, good)
    assert report.ok and any("crc trailers of 1 file" in n for n in report.notes)
    with pytest.raises(IntegrityError, match="crc mismatch"):
        verify.verify(good, str(bad))
    assert verify.verify(good, str(bad), read=ReadOptions(verify_crc=False)).differing == ["w"]


def test_encrypted_side(job, tmp_path) -> None:
    enc = _save(tmp_path / "enc.ckpt", _model(), enc_key=KEY, enc_mode="SM4-CBC")
    report = verify.verify(enc, job["r8"], b_strategy=job["s8"], read=api.ReadOptions(dec_key=KEY, dec_mode="SM4-CBC"))
    assert report.ok
    read_ckpt(enc, dec_key=KEY, dec_mode="SM4-CBC").close()


def test_bad_sides(job, tmp_path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        verify.verify(str(tmp_path / "nope"), job["full"])
    with pytest.raises(UsageError, match="strategy belongs"):
        verify.verify(job["full"], job["full"], a_strategy=job["s8"])
    with pytest.raises(UsageError, match="no strategy for them: give --a-strategy"):
        verify.verify(job["r8"], job["full"])
    with pytest.raises(UsageError, match="give --b-strategy"):
        verify.verify(job["full"], job["r8"])


# ------------------------------------------------------------------------------------ CLI


def test_cli_exit_codes_table_and_json(job, tmp_path) -> None:
    proc = run_cli("verify", job["r8"], job["r4"], "--a-strategy", job["s8"], "--b-strategy", job["s4"])
    assert proc.returncode == 0, proc.stderr
    assert "SAME" in proc.stdout and "65 match" in proc.stdout
    changed = dict(_model())
    changed["model.norm_out.weight"] = np.ones(8, np.float32)
    other = _save(tmp_path / "o.ckpt", changed)
    proc = run_cli("verify", job["full"], other, "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is False and data["summary"]["differ"] == 1
    assert [t["name"] for t in data["tensors"] if t["status"] == "differ"] == ["model.norm_out.weight"]
    proc = run_cli("verify", job["full"], str(tmp_path / "missing.ckpt"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_cli_encrypted_side_with_key_from_env(job, tmp_path) -> None:
    enc = _save(tmp_path / "enc.ckpt", _model(), enc_key=KEY)
    proc = run_cli(
        "verify",
        enc,
        job["r8"],
        "--b-strategy",
        job["s8"],
        "--dec-key-env",
        "RESHARD_TEST_KEY",
        env={"RESHARD_TEST_KEY": KEY.hex()},
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "verify", enc, job["full"], "--dec-key-env", "RESHARD_TEST_KEY", env={"RESHARD_TEST_KEY": bytes(16).hex()}
    )
    assert proc.returncode == 2 and "wrong key" in proc.stderr, proc.stderr
    assert KEY.hex() not in proc.stderr and bytes(16).hex() not in proc.stderr
    assert os.path.exists(enc)
