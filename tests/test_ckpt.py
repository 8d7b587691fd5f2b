"""The .ckpt reader/writer: docs/formats.md §8.1 byte vectors, round trips, chunking, crc, malformed input."""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.errors import (
    CryptoError,
    FormatError,
    IntegrityError,
    ReshardError,
    UnsupportedError,
    UsageError,
)
from reshard.formats import ckpt, index_memo
from reshard.formats.base import TensorSpec, fill_from_values, write_file
from reshard.formats.ckpt import SLICE_BYTES, ckpt_layout, crc_finish, read_ckpt, save_ckpt

# ------------------------------------------------------------------ an independent tiny encoder


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def fld(number: int, wire: int, payload: bytes | int) -> bytes:
    """One protobuf field: varint payloads as int, length-delimited as bytes, fixed as raw bytes."""
    key = varint(number << 3 | wire)
    if wire == 0:
        return key + varint(payload)  # type: ignore[arg-type]
    if wire == 2:
        return key + varint(len(payload)) + payload  # type: ignore[arg-type]
    return key + payload  # type: ignore[operator]


def tensor_proto(dims: list[int], type_name: str, content: bytes, extra: bytes = b"") -> bytes:
    return b"".join(fld(1, 0, d) for d in dims) + fld(2, 2, type_name.encode()) + extra + fld(3, 2, content)


def record(tag: str, tensor: bytes, extra: bytes = b"") -> bytes:
    return fld(1, 2, fld(1, 2, tag.encode()) + extra + fld(2, 2, tensor))


def write(tmp_path: Path, data: bytes, name: str = "x.ckpt") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def values_of(path: Path, **kwargs: object) -> dict[str, np.ndarray | str]:
    with read_ckpt(path, **kwargs) as index:  # type: ignore[arg-type]
        return {name: _copy(index.value(name)) for name in index}


def _copy(value: np.ndarray | str) -> np.ndarray | str:
    return value if isinstance(value, str) else np.array(value)


def assert_same(got: np.ndarray | str, want: np.ndarray | str) -> None:
    if isinstance(want, str):
        assert got == want.rstrip("\x00")
        return
    want = np.asarray(want)
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape
    assert got.tobytes() == want.astype(want.dtype.newbyteorder("=")).tobytes()


# ------------------------------------------------------------------------- docs/formats.md §8.1 vectors

V1 = bytes.fromhex("0a1a0a0177121508021207466c6f617433321a080000803f00000040")
APPEND_INT = bytes.fromhex("0a1e0a0965706f63685f6e756d12111205496e7436341a080100000000000000")
APPEND_STR = bytes.fromhex("0a190a046e6f74651211080012037374721a086100000062000000")
CRC_V1 = bytes.fromhex("6372635f6e756d") + bytes.fromhex("000000000000117599f0")
BF16 = bytes.fromhex("0a170a016212120802120842466c6f617431361a04803f60c0")
W = np.array([1.0, 2.0], np.float32)


def test_vector_v1(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"w": W})
    assert (tmp_path / "a.ckpt").read_bytes() == V1
    assert_same(values_of(tmp_path / "a.ckpt")["w"], W)


def test_vector_append_dict(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", [("w", W), ("epoch_num", np.array(1, np.int64)), ("note", "ab")])
    assert (tmp_path / "a.ckpt").read_bytes() == V1 + APPEND_INT + APPEND_STR
    got = values_of(tmp_path / "a.ckpt")
    assert list(got) == ["w", "epoch_num", "note"]
    assert_same(got["epoch_num"], np.array(1, np.int64))
    assert got["note"] == "ab"


def test_vector_crc(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"w": W}, write_crc=True)
    assert (tmp_path / "a.ckpt").read_bytes() == V1 + CRC_V1
    assert_same(values_of(tmp_path / "a.ckpt", verify_crc=True)["w"], W)
    assert_same(values_of(tmp_path / "a.ckpt")["w"], W)  # trailer always stripped


def test_vector_bf16(tmp_path: Path) -> None:
    b = np.array([1.0, -3.5], ml_dtypes.bfloat16)
    save_ckpt(tmp_path / "a.ckpt", {"b": b})
    assert (tmp_path / "a.ckpt").read_bytes() == BF16
    assert_same(values_of(tmp_path / "a.ckpt")["b"], b)


# ------------------------------------------------------------------------------ round trips

NUMPY_DTYPES = [d for d in dtypes.ALL if d not in (dtypes.STR, dtypes.INT4) and d.in_ckpt]  # .ckpt-capable


def sample(dtype: dtypes.DType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random values with every byte meaningful (bools are 0/1)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype is dtypes.BOOL:
        raw &= 1
    return raw.view(dtype.numpy).reshape(shape)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_every_dtype_round_trip(tmp_path: Path, dtype: dtypes.DType) -> None:
    arrays = {"m": sample(dtype, (3, 5)), "s": sample(dtype, ()), "e": sample(dtype, (2, 0, 3))}
    save_ckpt(tmp_path / "a.ckpt", arrays)
    with read_ckpt(tmp_path / "a.ckpt") as index:
        assert list(index) == ["m", "s", "e"]
        assert index.entries["m"].dtype is dtype
        assert index.entries["s"].shape == ()
        assert index.entries["e"].shape == (2, 0, 3)
        for name, arr in arrays.items():
            assert_same(np.array(index.array(name)), arr)


def test_scalar_has_no_dims(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"s": np.float32(3.0)})
    assert (tmp_path / "a.ckpt").read_bytes() == record("s", tensor_proto([], "Float32", b"\x00\x00\x40\x40"))


def test_empty_tensor_is_one_record(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"e": np.zeros((0, 3), np.float32)})
    assert (tmp_path / "a.ckpt").read_bytes() == record("e", tensor_proto([0, 3], "Float32", b""))
    assert values_of(tmp_path / "a.ckpt")["e"].shape == (0, 3)  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["", "ab", "hé€😀", "a\x00b", "x" * 3000])
def test_strings(tmp_path: Path, text: str) -> None:
    save_ckpt(tmp_path / "a.ckpt", [("s", text)], chunk_bytes=1024)  # strings are never chunked
    content = np.array(text).tobytes()  # what MindSpore stores; "" -> four zero bytes
    assert (tmp_path / "a.ckpt").read_bytes() == record("s", tensor_proto([0], "str", content))
    with read_ckpt(tmp_path / "a.ckpt") as index:
        assert index.entries["s"].dtype is dtypes.STR
        assert index.entries["s"].shape == (0,)
        assert index.value("s") == text


def test_numpy_string_scalar_and_big_endian(tmp_path: Path) -> None:
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    save_ckpt(tmp_path / "a.ckpt", {"s": np.array("hi"), "b": big})
    got = values_of(tmp_path / "a.ckpt")
    assert got["s"] == "hi"
    assert_same(got["b"], big)


def test_int4_is_raw_bytes_with_stored_dims(tmp_path: Path) -> None:
    # MindSpore 2.10 stores Tensor(int8 [[1,2],[3,4]], qint4x2) as dims [2,2], 4 content bytes.
    layout = ckpt_layout([TensorSpec("q", dtypes.INT4, (2, 2))])
    write_file(tmp_path / "q.ckpt", layout, fill_from_values({"q": np.array([[1, 2], [3, 4]], np.int8)}))
    assert (tmp_path / "q.ckpt").read_bytes().hex() == "0a150a01711210080208021204496e74341a0401020304"
    with read_ckpt(tmp_path / "q.ckpt") as index:
        assert index.entries["q"].dtype is dtypes.INT4
        assert index.entries["q"].shape == (2, 2)
        assert bytes(index.raw("q")) == b"\x01\x02\x03\x04"


def test_single_segment_is_zero_copy(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "a.ckpt", {"w": W})
    with read_ckpt(tmp_path / "a.ckpt") as index:
        assert isinstance(index.raw("w"), memoryview)
        assert index.format == "ckpt"


# -------------------------------------------------------------------------------- chunking


def test_chunking_2800_bytes(tmp_path: Path) -> None:
    arr = np.arange(700, dtype=np.float32)
    save_ckpt(tmp_path / "a.ckpt", [("w", arr), ("t", np.int8(5))], chunk_bytes=1024)
    data = (tmp_path / "a.ckpt").read_bytes()
    raw = arr.tobytes()
    want = b"".join(record("w", tensor_proto([700], "Float32", raw[i : i + 1024])) for i in (0, 1024, 2048))
    assert data == want + record("t", tensor_proto([], "Int8", b"\x05"))
    with read_ckpt(tmp_path / "a.ckpt") as index:
        assert [n for _, n in index.entries["w"].segments] == [1024, 1024, 752]
        assert list(index) == ["w", "t"]
        assert_same(index.array("w"), arr)


@pytest.mark.parametrize("nbytes", [1023, 1024, 1025, 2048])
def test_chunk_boundaries(tmp_path: Path, nbytes: int) -> None:
    arr = sample(dtypes.UINT8, (nbytes,))
    save_ckpt(tmp_path / "a.ckpt", {"u": arr}, chunk_bytes=1024)
    with read_ckpt(tmp_path / "a.ckpt") as index:
        lengths = [n for _, n in index.entries["u"].segments]
        assert lengths == [1024] * (nbytes // 1024) + ([nbytes % 1024] if nbytes % 1024 else [])
        assert_same(index.array("u"), arr)


def test_layout_of_a_multi_gigabyte_tensor_is_arithmetic() -> None:
    spec = TensorSpec("big", dtypes.FLOAT32, (2**30 + 3,))  # 4 GiB + 12 bytes: 9 records
    layout = ckpt_layout([spec, TensorSpec("s", dtypes.STR, (0,), 8)])
    segments = layout.placements["big"]
    assert [n for _, n in segments] == [SLICE_BYTES] * 8 + [12]
    assert len(layout.framing) == 10
    assert layout.order == ("big", "s")
    for (head_at, head), (data_at, _) in zip(layout.framing, segments, strict=False):
        assert head_at + len(head) == data_at
    assert layout.size == layout.framing[-1][0] + len(layout.framing[-1][1]) + 8
    assert layout.framing[0][1] == ckpt._record_head(b"big", [2**30 + 3], b"Float32", SLICE_BYTES)


def test_crc_finish_reads_in_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "CRC_BLOCK_BYTES", 7)
    arr = sample(dtypes.FLOAT64, (50,))
    save_ckpt(tmp_path / "a.ckpt", {"x": arr}, write_crc=True, chunk_bytes=100)
    data = (tmp_path / "a.ckpt").read_bytes()
    assert data[-17:] == b"crc_num" + zlib.crc32(data[:-17]).to_bytes(10, "big")
    assert_same(values_of(tmp_path / "a.ckpt", verify_crc=True)["x"], arr)


# ------------------------------------------------------------------------- crc and encryption


def test_crc_mismatch(tmp_path: Path) -> None:
    data = bytearray(V1 + CRC_V1)
    data[-25] ^= 0x01  # a tensor byte
    path = write(tmp_path, bytes(data))
    with pytest.raises(IntegrityError, match="crc mismatch"):
        read_ckpt(path, verify_crc=True)
    values_of(path)  # without crc_check the trailer is only stripped


def test_crc_missing_trailer(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="no crc trailer"):
        read_ckpt(write(tmp_path, V1), verify_crc=True)


@pytest.mark.parametrize(("magic", "mode"), [(0x7F3A5ED8, "AES-GCM"), (0x7F3A5EDA, "SM4-CBC")])
def test_encrypted_without_key(tmp_path: Path, magic: int, mode: str) -> None:
    path = write(tmp_path, struct.pack("<I", magic) + bytes(60))
    with pytest.raises(FormatError, match=rf"encrypted \({mode}\); give the key"):
        read_ckpt(path)


def test_key_for_plain_file(tmp_path: Path) -> None:
    with pytest.raises(CryptoError, match="not an encrypted"):
        read_ckpt(write(tmp_path, V1), dec_key=bytes(16))


KEYS = {"AES-GCM": bytes(range(32)), "AES-CBC": bytes(range(16)), "SM4-CBC": bytes(range(16, 32))}


@pytest.mark.parametrize("mode", list(KEYS))
def test_encrypted_round_trip(tmp_path: Path, mode: str) -> None:
    items = [("w", W), ("c", sample(dtypes.INT16, (900,))), ("s", "hé")]
    save_ckpt(tmp_path / "plain.ckpt", items, chunk_bytes=1024)
    save_ckpt(tmp_path / "enc.ckpt", items, chunk_bytes=1024, enc_key=KEYS[mode], enc_mode=mode)
    assert sorted(os.listdir(tmp_path)) == ["enc.ckpt", "plain.ckpt"]  # no plaintext left behind
    encrypted = (tmp_path / "enc.ckpt").read_bytes()
    assert (tmp_path / "plain.ckpt").read_bytes()[:64] not in encrypted
    got = values_of(tmp_path / "enc.ckpt", dec_key=KEYS[mode], dec_mode=mode)
    assert list(got) == ["w", "c", "s"]
    for name, value in items:
        assert_same(got[name], value)
    with pytest.raises(FormatError, match=rf"encrypted \({mode}\); give the key"):
        read_ckpt(tmp_path / "enc.ckpt")


def test_encrypted_wrong_key_or_mode(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "g.ckpt", {"w": W}, enc_key=KEYS["AES-GCM"])
    with pytest.raises(CryptoError):
        read_ckpt(tmp_path / "g.ckpt", dec_key=bytes(32))
    with pytest.raises(CryptoError):
        read_ckpt(tmp_path / "g.ckpt", dec_key=bytes(16), dec_mode="AES-CBC")
    save_ckpt(tmp_path / "c.ckpt", {"w": W}, enc_key=KEYS["AES-CBC"], enc_mode="AES-CBC")
    for key in (bytes([k]) * 16 for k in range(8)):  # garbage plaintext or bad padding: never raw errors
        with pytest.raises(CryptoError, match="wrong key or mode"):
            read_ckpt(tmp_path / "c.ckpt", dec_key=key, dec_mode="AES-CBC")


# -------------------------------------------------------------------- structure and malformed


def test_map_tensor_unsupported(tmp_path: Path) -> None:
    maptensor = fld(1, 2, tensor_proto([1], "int32", b"\x01\x00\x00\x00"))
    path = write(tmp_path, V1 + fld(1, 2, fld(1, 2, b"emb") + fld(3, 2, maptensor)))
    with pytest.raises(UnsupportedError, match="MapTensor"):
        read_ckpt(path)


def test_unknown_dtype(tmp_path: Path) -> None:
    path = write(tmp_path, record("c", tensor_proto([1], "HiFloat8", b"\x00")))
    with pytest.raises(FormatError, match="'c' at byte 0: unknown MindSpore tensor type 'HiFloat8'"):
        read_ckpt(path)


def test_unknown_fields_are_skipped_and_packed_dims_read(tmp_path: Path) -> None:
    unknown = fld(9, 0, 300) + fld(10, 1, bytes(8)) + fld(11, 2, b"future") + fld(12, 5, bytes(4))
    tensor = fld(1, 2, varint(2) + varint(1)) + fld(2, 2, b"Float32") + unknown + fld(3, 2, W.tobytes())
    data = unknown + fld(1, 2, unknown + fld(1, 2, b"w") + fld(2, 2, tensor)) + unknown
    with read_ckpt(write(tmp_path, data)) as index:
        assert index.entries["w"].shape == (2, 1)
        assert_same(np.array(index.array("w")).reshape(2), W)


def test_repeated_tag_overwrites_in_first_position(tmp_path: Path) -> None:
    one, two = np.array([1], np.int32), np.array([2, 3], np.int16)
    data = (
        record("a", tensor_proto([1], "Int32", one.tobytes()))
        + record("b", tensor_proto([], "Bool", b"\x01"))
        + record("a", tensor_proto([2], "Int16", two.tobytes()))
    )
    got = values_of(write(tmp_path, data))
    assert list(got) == ["a", "b"]
    assert_same(got["a"], two)


BAD_FILES = {
    "empty file": (b"", "no parameters"),
    "only a crc trailer": (CRC_V1, "no parameters"),
    "truncated": (V1[:-3], "runs past the end"),
    "truncated varint": (b"\x0a\x80", "truncated varint"),
    "varint too long": (b"\x0a" + b"\xff" * 11, "longer than 10 bytes"),
    "field zero": (b"\x02\x00", "field number 0"),
    "group wire type": (b"\x0b", "wire type 3"),
    "tag wire type": (fld(1, 2, fld(1, 0, 5) + fld(2, 2, tensor_proto([], "Int8", b"\x00"))), "wire type 0"),
    "value wire type": (fld(1, 0, 1), "Checkpoint.value has wire type 0"),
    "no tag": (fld(1, 2, fld(2, 2, tensor_proto([], "Int8", b"\x00"))), "without a tag"),
    "no tensor": (fld(1, 2, fld(1, 2, b"a")), "without a tensor"),
    "no type": (record("a", fld(3, 2, b"\x00")), "without tensor_type"),
    "no content": (record("a", fld(2, 2, b"Int8")), "without tensor_content"),
    "size mismatch": (record("a", tensor_proto([3], "Int16", b"\x00" * 4)), "4 content bytes"),
    "negative dim": (record("a", fld(1, 0, 2**64 - 1) + tensor_proto([], "Int8", b"")), "negative dim"),
    "bad utf-8 tag": (fld(1, 2, fld(1, 2, b"\xff") + fld(2, 2, tensor_proto([], "Int8", b"\x00"))), "UTF-8"),
    "odd string": (record("s", tensor_proto([0], "str", b"abc")), "not UTF-32"),
    "chunks disagree": (
        record("a", tensor_proto([2], "Int8", b"\x00")) + record("a", tensor_proto([3], "Int8", b"\x00")),
        "disagrees",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_malformed_files(tmp_path: Path, case: str) -> None:
    data, message = BAD_FILES[case]
    path = write(tmp_path, data)
    with pytest.raises(FormatError, match=message) as info:
        read_ckpt(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot open"):
        read_ckpt(tmp_path / "nope.ckpt")


# ---------------------------------------------------------------------------- writer errors


@pytest.mark.parametrize(
    ("tensors", "kwargs", "message"),
    [
        ([("a", W), ("a", W)], {}, "twice"),
        ({"a": W}, {"chunk_bytes": 0}, "chunk_bytes"),
        ({"a": W}, {"write_crc": True, "enc_key": bytes(16)}, "mutually exclusive"),
        ({"a": np.array([object()])}, {}, "no MindSpore equivalent"),
        ({"a": np.array(["x", "y"])}, {}, "0-d string"),
        ({"\udc80": W}, {}, "UTF-8"),
        ([(1, W)], {}, "names must be strings"),
        ({"a": W}, {"enc_key": bytes(15)}, "16 or 24 or 32-byte key"),
        ({"a": W}, {"enc_key": bytes(16), "enc_mode": "DES-CBC"}, "unknown encryption mode"),
    ],
)
def test_save_usage_errors(tmp_path: Path, tensors: object, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        save_ckpt(tmp_path / "a.ckpt", tensors, **kwargs)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_layout_rejects_inconsistent_specs() -> None:
    with pytest.raises(UsageError, match="nbytes"):
        ckpt_layout([TensorSpec("a", dtypes.FLOAT32, (2,), 4)])
    with pytest.raises(UsageError, match="not UTF-32"):
        ckpt_layout([TensorSpec("s", dtypes.STR, (0,), 3)])


def test_crc_finish_on_short_file(tmp_path: Path) -> None:
    layout = ckpt_layout([TensorSpec("a", dtypes.FLOAT32, (2,))])
    path = tmp_path / "short"
    path.write_bytes(b"\x00")
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(IntegrityError, match="file ends"):
            crc_finish(fd, layout)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ hypothesis

NAMES = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
STRINGS = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def tensor_sets(draw: st.DrawFn) -> list[tuple[str, np.ndarray | str]]:
    names = draw(st.lists(NAMES, max_size=6, unique=True))
    items: list[tuple[str, np.ndarray | str]] = []
    for i, name in enumerate(names):
        if draw(st.integers(0, 5)) == 0:
            items.append((name, draw(STRINGS)))
        else:
            items.append((name, sample(draw(st.sampled_from(NUMPY_DTYPES)), draw(SHAPES), seed=i)))
    return items


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=tensor_sets(), chunk=st.sampled_from([SLICE_BYTES, 1, 5, 16]), crc=st.booleans())
def test_round_trip_property(tmp_path: Path, items: list[tuple[str, np.ndarray | str]], chunk: int, crc: bool) -> None:
    path = tmp_path / "p.ckpt"
    if not items:
        save_ckpt(path, items)
        with pytest.raises(FormatError, match="no parameters"):
            read_ckpt(path)
        return
    save_ckpt(path, items, chunk_bytes=chunk, write_crc=crc)
    got = values_of(path, verify_crc=crc)
    assert list(got) == [name for name, _ in items]
    for name, value in items:
        assert_same(got[name], value)


def _valid_file() -> bytes:
    items = [("w", W), ("bf", np.array([[1.0, -3.5]], ml_dtypes.bfloat16)), ("s", "hé"), ("n", np.int64(7))]
    items += [("e", np.zeros((0, 2), np.uint16)), ("c", np.arange(9, dtype=np.int32))]
    return b"".join(
        record(n, tensor_proto([0], "str", np.array(v).tobytes()))
        if isinstance(v, str)
        else record(n, tensor_proto(list(np.shape(v)), dtypes.from_numpy(v.dtype).ms_name, v.tobytes()))
        for n, v in items
    )


VALID = _valid_file()
VALID_CRC = VALID + b"crc_num" + zlib.crc32(VALID).to_bytes(10, "big")


def _read_all_or_reshard_error(path: Path, crc_check: bool) -> None:
    with contextlib.suppress(ReshardError):
        values_of(path, verify_crc=crc_check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.sampled_from([VALID, VALID_CRC]), cut=st.integers(0, len(VALID_CRC)), crc=st.booleans())
def test_truncations_raise_only_reshard_errors(tmp_path: Path, data: bytes, cut: int, crc: bool) -> None:
    _read_all_or_reshard_error(write(tmp_path, data[:cut]), crc)


FLIP_BITS = st.integers(0, 8 * len(VALID_CRC) - 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.sampled_from([VALID, VALID_CRC]), bit=FLIP_BITS, crc=st.booleans())
def test_bit_flips_raise_only_reshard_errors(tmp_path: Path, data: bytes, bit: int, crc: bool) -> None:
    flipped = bytearray(data)
    flipped[(bit // 8) % len(data)] ^= 1 << (bit % 8)
    _read_all_or_reshard_error(write(tmp_path, bytes(flipped)), crc)


# ------------------------------------------------------------------ the index memo (one walk a run)


@pytest.fixture
def counted_walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files ``read_ckpt`` walked (indexed afresh), with a fresh memo and a 0.05 s settling time
    (and no twins: ``test_ckpt_twins``)."""
    walked: list[str] = []
    real = ckpt._index
    monkeypatch.setattr(ckpt, "_MEMO", index_memo.IndexMemo())
    monkeypatch.setattr(index_memo, "SETTLED_SECONDS", 0.05)
    monkeypatch.setattr(ckpt._TWINS, "checked", lambda fd, size, end: None)

    def counting(scan: object, end: int, recorder: object = None) -> object:
        walked.append(scan.path)  # type: ignore[attr-defined]
        return real(scan, end, recorder)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt, "_index", counting)
    return walked


def _values(path: Path) -> dict[str, np.ndarray]:
    with read_ckpt(path) as index:
        return {name: index.array(name).copy() for name in index.entries}


def test_a_settled_file_is_indexed_once(tmp_path: Path, counted_walks: list[str]) -> None:
    path = tmp_path / "m.ckpt"
    save_ckpt(path, {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.int32)})
    time.sleep(0.1)
    first, second = _values(path), _values(path)
    assert counted_walks == [str(path)]
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


def test_a_file_written_lately_is_indexed_every_time(tmp_path: Path, counted_walks: list[str]) -> None:
    path = tmp_path / "m.ckpt"
    save_ckpt(path, {"a": np.arange(6, dtype=np.float32)})
    _values(path)
    _values(path)
    assert counted_walks == [str(path), str(path)]


def test_a_file_rewritten_in_place_is_indexed_again(tmp_path: Path, counted_walks: list[str]) -> None:
    """Same inode and size, other tensor names: the write's ctime changes the key."""
    path = tmp_path / "m.ckpt"
    save_ckpt(path, {"a": np.arange(6, dtype=np.float32)})
    time.sleep(0.1)
    assert list(_values(path)) == ["a"]
    other = tmp_path / "other.ckpt"
    save_ckpt(other, {"z": np.arange(6, dtype=np.float32)})
    inode = path.stat().st_ino
    with open(path, "r+b") as fh:  # in place, as `cp -p` over an existing file would
        fh.write(other.read_bytes())
    assert path.stat().st_ino == inode and path.stat().st_size == other.stat().st_size
    assert list(_values(path)) == ["z"]
    assert counted_walks == [str(path), str(path)]


def test_encrypted_files_are_never_remembered(tmp_path: Path, counted_walks: list[str]) -> None:
    path = tmp_path / "m.ckpt"
    save_ckpt(path, {"a": np.arange(6, dtype=np.float32)}, enc_key=KEYS["AES-GCM"])
    time.sleep(0.1)
    for _ in range(2):
        with read_ckpt(path, dec_key=KEYS["AES-GCM"]) as index:
            assert list(index.entries) == ["a"]
    assert len(counted_walks) == 2
