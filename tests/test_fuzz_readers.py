"""Fuzzing every reader: .ckpt (plain, crc, encrypted), safetensors, strategy files (protobuf and
JSON, through to the layout map) and the decryption layer.

Mutations of valid files (truncations, bit flips, overwritten bytes, random headers and lying
length fields) must end in a ``ReshardError`` or a successful read whose every value can be
touched; never another exception, never a hang (a per-example alarm), and never an allocation
much larger than the file (tracemalloc peak <= ``MEMORY_FACTOR`` x file size + ``MEMORY_SLACK``;
memory maps are not allocations, so a reader that trusts a lying size and allocates is caught).
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from reshard.errors import ReshardError
from reshard.formats import crypto
from reshard.formats.ckpt import read_ckpt, save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import PROTOBUF, encode_strategy, make_strategy, read_strategy
from reshard.layout import ParamLayout, device_num, layout_map, stage_count
from reshard.text import one_line

EXAMPLE_SECONDS = 3.0  # a reader of a few KiB that takes longer is hanging
MEMORY_FACTOR = 16
MEMORY_SLACK = 2 * 1024 * 1024  # interpreter noise, protobuf/JSON objects of small headers
KEY = bytes(range(32))
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Hang(Exception):
    pass


@contextlib.contextmanager
def bounded(size: int, seconds: float = EXAMPLE_SECONDS) -> Iterator[None]:
    """Fail on a hang (SIGALRM) or on allocations beyond the memory bound."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"reader still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak <= MEMORY_FACTOR * size + MEMORY_SLACK, f"peak {peak} bytes for a {size}-byte input"
    finally:
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def read_or_reshard_error(read: Callable[[], Any], size: int, seconds: float = EXAMPLE_SECONDS) -> None:
    """``read`` must succeed (then every value is touched) or raise a ReshardError."""
    with bounded(size, seconds):
        try:
            _touch(read())
        except ReshardError as exc:
            assert "\n" not in one_line(str(exc))  # what the CLI prints is one line


def _touch(result: Any) -> None:
    if hasattr(result, "entries"):  # a TensorIndex
        with result as index:
            for name in index:
                value = index.value(name)
                if isinstance(value, np.ndarray) and value.size:
                    value.reshape(-1)[-1:].tobytes()


# ------------------------------------------------------------------------------------ seeds


def _ckpt_seed(tmp: Path, **kw: Any) -> bytes:
    values = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(5, dtype=ml_dtypes.bfloat16),
        "step": np.array([7], np.int32),
        "name": "fuzz",
        "scalar": np.array(1.5, np.float64),
    }
    path = tmp / "seed.ckpt"
    save_ckpt(path, values, chunk_bytes=16, **kw)
    return path.read_bytes()


def _st_seed(tmp: Path) -> bytes:
    path = tmp / "seed.safetensors"
    save_safetensors(
        path,
        {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.arange(3, dtype=np.int8)},
        metadata={"format": "ms"},
    )
    return path.read_bytes()


def _strategy_seed() -> tuple[bytes, bytes]:
    layouts = {
        "w": ParamLayout((2, 2), (1, 0), 2, 2),
        "b": ParamLayout((2, 2), (-1,)),
        "e": ParamLayout((2, 1, 2), ((2, 0), (-1,))),
    }
    sf = make_strategy(layouts, stage=1, tensor_shapes={"w": (8, 4)})
    flat = make_strategy({k: v for k, v in layouts.items() if k != "e"}, stage=1, tensor_shapes={"w": (8, 4)})
    return encode_strategy(sf, PROTOBUF), encode_strategy(flat, "json")  # JSON holds flat tensor maps only


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("seeds")
    pb, js = _strategy_seed()
    out = {
        "ckpt": _ckpt_seed(tmp),
        "ckpt_crc": _ckpt_seed(tmp, write_crc=True),
        "safetensors": _st_seed(tmp),
        "strategy.ckpt": pb,
        "strategy.json": js,
    }
    for mode in crypto.MODES:
        key = KEY[:16] if mode == "SM4-CBC" else KEY
        buf = io.BytesIO()
        crypto.encrypt_stream(io.BytesIO(out["ckpt"]), buf, key, mode)
        out[mode] = buf.getvalue()
    return out


# ------------------------------------------------------------------------------------ mutations


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """A truncation, bit flips, an overwritten run of bytes, or an inserted run, of ``seed``."""
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert"]))
    data = bytearray(seed)
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if kind == "flip":
        for bit in draw(st.lists(st.integers(0, len(data) * 8 - 1), min_size=1, max_size=8)):
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data)
    at = draw(st.integers(0, len(data)))
    run = draw(st.binary(min_size=1, max_size=24) | st.sampled_from([b"\xff" * 10, b"\x7f" * 8, bytes(8)]))
    if kind == "overwrite":
        data[at : at + len(run)] = run
    else:
        data[at:at] = run
    return bytes(data)


def _write(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


# ------------------------------------------------------------------------------------ .ckpt


@FUZZ
@given(data=st.data(), which=st.sampled_from(["ckpt", "ckpt_crc"]), crc=st.booleans())
def test_read_ckpt_mutations(seeds, tmp_path, data, which: str, crc: bool) -> None:
    raw = data.draw(mutated(seeds[which]))
    path = _write(tmp_path, "f.ckpt", raw)
    read_or_reshard_error(lambda: read_ckpt(path, verify_crc=crc), len(raw))


@FUZZ
@given(raw=st.binary(max_size=512))
@example(raw=b"\x0a\xff\xff\xff\xff\x0f")
@example(raw=b"\x0a\x20\x0a\x01w\x12\x1b\x08\x80\x80\x80\x80\x80\x80\x80\x80\x01\x12\x07Float32\x1a\x08" + bytes(8))
def test_read_ckpt_random_bytes(tmp_path, raw: bytes) -> None:
    path = _write(tmp_path, "r.ckpt", raw)
    read_or_reshard_error(lambda: read_ckpt(path), len(raw))


# ------------------------------------------------------------------------------------ decryption


@FUZZ
@given(data=st.data(), mode=st.sampled_from(crypto.MODES), wrong_mode=st.booleans())
def test_decrypt_mutations(seeds, tmp_path, data, mode: str, wrong_mode: bool) -> None:
    raw = data.draw(mutated(seeds[mode]))
    key = KEY[:16] if mode == "SM4-CBC" else KEY
    dec_mode = "AES-GCM" if wrong_mode and mode != "AES-GCM" else mode
    if dec_mode != mode:
        key = KEY
    path = _write(tmp_path, "e.ckpt", raw)
    read_or_reshard_error(lambda: read_ckpt(path, dec_key=key, dec_mode=dec_mode), len(raw))
    read_or_reshard_error(lambda: crypto.decrypt_stream(raw, io.BytesIO(), key, dec_mode, path), len(raw))


@FUZZ
@given(
    mode=st.sampled_from(crypto.MODES),
    block_size=st.integers(-(2**31), 2**31 - 1),
    iv_len=st.integers(-(2**31), 2**31 - 1),
    cipher_len=st.integers(-(2**31), 2**31 - 1),
    tail=st.binary(max_size=64),
)
def test_decrypt_lying_record_headers(
    tmp_path, mode: str, block_size: int, iv_len: int, cipher_len: int, tail: bytes
) -> None:
    magic = {"AES-GCM": 0x7F3A5ED8, "AES-CBC": 0x7F3A5ED9, "SM4-CBC": 0x7F3A5EDA}[mode]
    tag = bytes(16) if mode == "AES-GCM" else b""
    raw = struct.pack("<I", magic) + tag + struct.pack("<ii", block_size, iv_len) + bytes(16)
    raw += struct.pack("<i", cipher_len) + tail
    key = KEY[:16] if mode == "SM4-CBC" else KEY
    read_or_reshard_error(lambda: crypto.decrypt_stream(raw, io.BytesIO(), key, mode, "x.ckpt"), len(raw))


# ------------------------------------------------------------------------------------ safetensors


@FUZZ
@given(data=st.data())
def test_read_safetensors_mutations(seeds, tmp_path, data) -> None:
    raw = data.draw(mutated(seeds["safetensors"]))
    path = _write(tmp_path, "f.safetensors", raw)
    read_or_reshard_error(lambda: read_safetensors(path), len(raw))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "I8", "F64", "BOOL", "Q8", ""]) | JSON_VALUES,
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | JSON_VALUES,
        "data_offsets": st.lists(st.integers(-2, 2**64), min_size=0, max_size=3) | JSON_VALUES,
    },
)


@FUZZ
@given(
    header=st.dictionaries(st.text(max_size=6), ENTRY | JSON_VALUES, max_size=4),
    metadata=st.none() | st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3),
    length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]),
    data=st.binary(max_size=96),
)
def test_read_safetensors_random_headers(tmp_path, header, metadata, length_delta: int, data: bytes) -> None:
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    text = json.dumps(header).encode()
    raw = struct.pack("<Q", max(0, len(text) + length_delta)) + text + data
    path = _write(tmp_path, "h.safetensors", raw)
    read_or_reshard_error(lambda: read_safetensors(path), len(raw))


# ------------------------------------------------------------------------------------ strategies


def _strategy_and_layouts(path: str) -> Callable[[], Any]:
    def read() -> Any:
        sf = read_strategy(path)
        if any(not isinstance(n, str) for n in sf.layouts):
            reject()  # known: invalid UTF-8 names come back as bytes (test_strategy_name_not_utf8 below)
        device_num(sf) if sf.layouts else None
        stage_count(sf)
        layout_map(sf)
        return sf

    return read


@FUZZ
@given(data=st.data(), which=st.sampled_from(["strategy.ckpt", "strategy.json"]))
def test_read_strategy_mutations(seeds, tmp_path, data, which: str) -> None:
    raw = data.draw(mutated(seeds[which]))
    path = _write(tmp_path, which, raw)
    read_or_reshard_error(_strategy_and_layouts(path), len(raw))


LAYOUT_ITEM = st.fixed_dictionaries(
    {
        "dev_matrix": st.lists(st.integers(-1, 5), max_size=3) | JSON_VALUES,
        "tensor_map": st.lists(st.integers(-2, 3) | st.lists(st.integers(-2, 3), max_size=2), max_size=3) | JSON_VALUES,
        "field": st.integers(-1, 2) | JSON_VALUES,
        "opt_weight_shard_step": st.integers(-1, 4) | JSON_VALUES,
        "opt_weight_shard_size": st.integers(-2, 4) | JSON_VALUES,
    },
)


@FUZZ
@given(
    items=st.dictionaries(st.text(min_size=1, max_size=6), LAYOUT_ITEM | JSON_VALUES, max_size=3),
    stage=st.integers(-1, 3) | JSON_VALUES,
    extra=st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=2),
)
def test_read_strategy_random_json(tmp_path, items, stage, extra) -> None:
    doc = {
        "current_stage": 1,
        "parallel_strategy_item": {"op": {"stage": stage, "parallel_strategy": [[1]]}},
        "parallel_layout_item": items,
        **extra,
    }
    raw = json.dumps(doc).encode()
    path = _write(tmp_path, "s.json", raw)
    read_or_reshard_error(_strategy_and_layouts(path), len(raw))


# ------------------------------------------------------------------------------------ the harness itself


def _spin() -> None:
    while True:
        pass


def test_harness_catches_big_allocations_hangs_and_foreign_errors() -> None:
    with pytest.raises(AssertionError, match="peak"):
        read_or_reshard_error(lambda: np.ones(8 * 1024 * 1024), 100)
    with pytest.raises(Hang):
        read_or_reshard_error(_spin, 100, seconds=0.2)
    with pytest.raises(IndexError):
        read_or_reshard_error(lambda: [][1], 100)
    read_or_reshard_error(lambda: (_ for _ in ()).throw(ReshardError("one line")), 100)


def test_strategy_name_not_utf8(seeds, tmp_path) -> None:
    raw = seeds["strategy.ckpt"].replace(b"\n\x01e\x12", b"\n\x01\xe5\x12")  # parameter "e" -> byte 0xE5
    assert raw != seeds["strategy.ckpt"]
    path = _write(tmp_path, "s.ckpt", raw)
    read_or_reshard_error(lambda: layout_map(read_strategy(path)), len(raw))
