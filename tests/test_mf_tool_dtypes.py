"""Every dtype both safetensors and ml_dtypes know, carried byte for byte (issue 11, "Dtypes").

``F8_E8M0`` (``ml_dtypes.float8_e8m0fnu``, the block scales of FP8 / MXFP4 checkpoints) and the
``FNUZ`` float8 variants have no MindSpore 2.10 tensor type: they travel through safetensors and
every reshard operation, and a ``.ckpt`` output holding one is one line naming the tensor. The
references are the ``safetensors`` package itself: its ``numpy.save`` writes the bytes we must
write, its Rust parser (``safetensors.deserialize``) reads ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import deserialize
from safetensors.numpy import save as lib_save

from reshard import api, dtypes
from reshard.formats.ckpt import save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L

# safetensors code -> numpy type: every byte-sized dtype of the safetensors package (0.8) that
# numpy or ml_dtypes can hold. F4, F6_E2M3 and F6_E3M2 pack values below a byte (refused, below).
BOTH = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "C64": np.complex64,
    "F64": np.float64,
    "I64": np.int64,
    "U64": np.uint64,
}
NO_MINDSPORE_NAME = {"F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
RNG = np.random.default_rng(11)
ROOT = Path(__file__).resolve().parent.parent


def sample(code: str, shape: tuple[int, ...] = (4, 6)) -> np.ndarray:
    """Random bytes viewed as the dtype (every bit pattern, NaNs included: bytes are what must survive)."""
    itemsize = np.dtype(BOTH[code]).itemsize
    raw = RNG.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    if code == "BOOL":
        raw = raw % 2
    return raw.view(BOTH[code]).reshape(shape)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_the_table_knows_every_code() -> None:
    for code, np_type in BOTH.items():
        d = dtypes.from_st_code(code)
        assert d.numpy == np.dtype(np_type) and d.st_code == code
        assert dtypes.from_numpy(np.dtype(np_type)).st_code == code
        assert d.in_ckpt is (code not in NO_MINDSPORE_NAME)
    assert str(dtypes.FLOAT8_E8M0) == "F8_E8M0"  # shown under its safetensors code
    with pytest.raises(Exception, match="unknown MindSpore tensor type"):
        dtypes.from_ms_name("F8_E8M0")  # no .ckpt ever names it


@pytest.mark.parametrize("code", sorted(BOTH))
def test_written_like_the_library_and_read_by_it(tmp_path: Path, code: str) -> None:
    tensors = {"a": sample(code), "b": sample(code, (3,)), "f": np.arange(3, dtype=np.float32)}
    ours = tmp_path / "ours.safetensors"
    save_safetensors(ours, tensors, metadata={"format": "ms"})
    assert ours.read_bytes() == lib_save(tensors, metadata={"format": "ms"})
    parsed = dict(deserialize(ours.read_bytes()))
    assert parsed["a"]["dtype"] == code and bytes(parsed["a"]["data"]) == tensors["a"].tobytes()
    theirs = tmp_path / "theirs.safetensors"
    theirs.write_bytes(lib_save(tensors))
    with read_safetensors(theirs) as index:
        assert index.entries["a"].dtype.st_code == code
        assert index.array("a").tobytes() == tensors["a"].tobytes()
        assert index.array("a").dtype == np.dtype(BOTH[code])


@pytest.mark.parametrize("code", sorted(BOTH))
def test_reshard_round_trip(tmp_path: Path, code: str) -> None:
    """Full -> 2x2 ranks (rows and columns split) -> full gives the library's bytes back."""
    tensors = {"w": sample(code, (4, 6)), "v": sample(code, (6,))}
    full = tmp_path / "full" / "m.safetensors"
    full.parent.mkdir()
    full.write_bytes(lib_save(tensors, metadata={"format": "ms"}))
    strategy = str(tmp_path / "s.ckpt")
    write_strategy(strategy, make_strategy({"w": L((2, 2), (1, 0)), "v": L((2, 2), (0,))}))
    api.transform(str(full), str(tmp_path / "r4"), None, strategy)
    with read_safetensors(tmp_path / "r4" / "rank_1" / "checkpoint_1.safetensors") as index:
        assert index.array("w").tobytes() == np.ascontiguousarray(tensors["w"][0:2, 3:6]).tobytes()
    api.transform(str(tmp_path / "r4"), str(tmp_path / "back"), strategy, None)
    back = tmp_path / "back" / "rank_0" / "checkpoint_0.safetensors"
    assert back.read_bytes() == full.read_bytes()


@pytest.mark.parametrize("code", sorted(set(BOTH) - NO_MINDSPORE_NAME))
def test_ckpt_safetensors_ckpt_is_byte_exact(tmp_path: Path, code: str) -> None:
    tensors = {"a": sample(code, ()), "w": sample(code)}  # name order: safetensors sorts by name
    src = tmp_path / "a" / "m.ckpt"
    src.parent.mkdir()
    save_ckpt(src, tensors)
    api.convert(str(src), str(tmp_path / "st"), "safetensors", destination=api.Destination(manifest=False))
    st_file = tmp_path / "st" / "m.safetensors"
    assert dict(deserialize(st_file.read_bytes()))["w"]["dtype"] == code
    api.convert(str(st_file), str(tmp_path / "back"), "ckpt", destination=api.Destination(manifest=False))
    assert (tmp_path / "back" / "m.ckpt").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("code", sorted(NO_MINDSPORE_NAME))
def test_no_ckpt_for_dtypes_mindspore_cannot_name(tmp_path: Path, code: str) -> None:
    src = tmp_path / "m.safetensors"
    src.write_bytes(lib_save({"w": np.ones(2, np.float32), "scale": sample(code, (2, 2))}))
    proc = cli("convert", str(src), str(tmp_path / "out"), "--to", "ckpt")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "'scale'" in proc.stderr and code in proc.stderr
    assert not (tmp_path / "out").exists()
    strategy = str(tmp_path / "s.ckpt")
    write_strategy(strategy, make_strategy({"scale": L((2,), (0, -1))}))
    proc = cli("transform", "--src", str(src), "--dst", str(tmp_path / "r2"), "--dst-strategy", strategy,
               "--output-format", "ckpt")  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and code in proc.stderr, proc.stderr
    assert not (tmp_path / "r2").exists() or not any(p.is_file() for p in (tmp_path / "r2").rglob("*"))


@pytest.mark.parametrize("code", ["F4", "F6_E2M3", "F6_E3M2"])
def test_sub_byte_codes_are_refused_in_one_line(tmp_path: Path, code: str) -> None:
    header = json.dumps({"t": {"dtype": code, "shape": [8], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "packed.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    proc = cli("inspect", str(path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and code in proc.stderr, proc.stderr


def test_inspect_shows_the_new_dtypes(tmp_path: Path) -> None:
    tensors = {"scale": sample("F8_E8M0", (2, 3)), "w": sample("F8_E4M3", (2, 3)), "c": sample("C64", (2,))}
    path = tmp_path / "m.safetensors"
    path.write_bytes(lib_save(tensors))
    proc = cli("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)["tensors"]}
    assert rows["scale"]["dtype"] == "F8_E8M0" and rows["scale"]["shape"] == [2, 3] and rows["scale"]["bytes"] == 6
    assert rows["w"]["dtype"] == "Float8E4M3FN" and rows["c"]["dtype"] == "Complex64"
    table = cli("inspect", str(path))
    assert table.returncode == 0 and "F8_E8M0" in table.stdout


def test_env_is_ours() -> None:
    assert os.path.realpath(api.__file__).startswith(str(ROOT))
