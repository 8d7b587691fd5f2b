"""``formats.strategy_proto``: the hand-written strategy reader gives what the protobuf runtime gives.

Every test compares the two readers on the same bytes: generated messages (any field values,
names in any script, list tensor maps, negative and 64-bit numbers), encodings the runtime never
writes but must read (packed numbers, a singular message given twice, unknown fields and groups),
and corrupted files (truncated, a byte changed, bytes inserted), where both must refuse or both
must read the same ``StrategyFile``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.errors import FormatError
from reshard.formats import strategy
from reshard.formats.strategy_proto import WIRE_LIMIT, WireError, decode

SRC = str(Path(__file__).resolve().parent.parent / "src")
UINT32 = st.integers(0, 2**32 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
NAMES = st.text(min_size=0, max_size=12)


def read_wire(data: bytes) -> strategy.StrategyFile:
    return strategy._from_message(decode(data), None)


def read_runtime(data: bytes) -> strategy.StrategyFile:
    return strategy._from_message(strategy._parse_message(data, "s.ckpt"), None)


def outcome(read: Any, data: bytes) -> tuple[str, Any]:
    """("ok", the file) or ("error", None) for a refusal of either reader's kind."""
    try:
        return "ok", read(data)
    except (WireError, FormatError):
        return "error", None


def same(data: bytes) -> None:
    wire, runtime = outcome(read_wire, data), outcome(read_runtime, data)
    assert wire == runtime, (data.hex(), wire, runtime)


@st.composite
def messages(draw: Any) -> bytes:
    msg = strategy.message_classes()["ParallelStrategyMap"]()
    msg.current_stage = draw(UINT32)
    for _ in range(draw(st.integers(0, 3))):
        item = msg.parallel_strategy_item.add(node_name=draw(NAMES))
        item.parallel_strategys.stage = draw(UINT32)
        for dims in draw(st.lists(st.lists(UINT32, max_size=4), max_size=3)):
            item.parallel_strategys.parallel_strategy.add().dim.extend(dims)
    for _ in range(draw(st.integers(0, 4))):
        item = msg.parallel_layout_item.add(param_name=draw(NAMES))
        pl = item.parallel_layouts
        for dims in draw(st.lists(st.lists(UINT32, max_size=4), min_size=0, max_size=2)):
            pl.dev_matrix.add().dim.extend(dims)
        for dims in draw(st.lists(st.lists(INT32, max_size=4), max_size=3)):
            pl.tensor_map.add().dim.extend(dims)
        for dims in draw(st.lists(st.lists(INT64, max_size=3), max_size=2)):
            pl.param_split_shape.add().dim.extend(dims)
        for dims in draw(st.lists(st.lists(INT64, max_size=3), max_size=2)):
            pl.indices_offset.add().dim.extend(dims)
        pl.field, pl.opt_weight_shard_step, pl.opt_weight_shard_size = draw(INT32), draw(INT32), draw(INT32)
    data: bytes = msg.SerializeToString()
    return data


@settings(max_examples=300, deadline=None)
@given(messages())
def test_generated_files_read_the_same(data: bytes) -> None:
    same(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.integers(0, 2**16), st.binary(min_size=1, max_size=4), st.sampled_from(["cut", "set", "insert"]))
def test_corrupted_files_refused_or_read_the_same(data: bytes, where: int, junk: bytes, how: str) -> None:
    at = where % (len(data) + 1)
    if how == "cut":
        data = data[:at]
    elif how == "set":
        data = data[:at] + junk[:1] + data[at + 1 :]
    else:
        data = data[:at] + junk + data[at:]
    same(data)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def layouts(dev: bytes, extra: bytes = b"") -> bytes:
    """A ParallelLayouts payload: ``dev`` as its dev_matrix bytes, the three required numbers, ``extra``."""
    return delimited(1, dev) + tag(5, 0) + b"\x00" + tag(6, 0) + b"\x00" + tag(7, 0) + b"\x00" + extra


def one_layout(payload: bytes, name: bytes = b"w") -> bytes:
    return tag(1, 0) + b"\x01" + delimited(3, delimited(1, name) + delimited(2, payload))


def test_packed_numbers_read_like_unpacked() -> None:
    packed = one_layout(
        layouts(delimited(1, varint(4) + varint(2)), delimited(2, delimited(1, varint(0) + varint(-1))))
    )
    unpacked_map = delimited(2, tag(1, 0) + varint(0) + tag(1, 0) + varint(-1))
    unpacked = one_layout(layouts(tag(1, 0) + varint(4) + tag(1, 0) + varint(2), unpacked_map))
    assert read_wire(packed) == read_wire(unpacked) == read_runtime(packed) == read_runtime(unpacked)
    assert read_wire(packed).layouts["w"].dev_matrix == (4, 2)
    assert read_wire(packed).layouts["w"].tensor_map == (0, -1)


def test_a_singular_message_given_twice_is_merged() -> None:
    item = delimited(1, b"w") + delimited(2, layouts(delimited(1, varint(2))))
    again = delimited(2, tag(6, 0) + varint(3))  # parallel_layouts again: only opt_weight_shard_step
    data = tag(1, 0) + b"\x01" + delimited(3, item + again)
    assert read_wire(data).layouts["w"].opt_shard_step == 3 == read_runtime(data).layouts["w"].opt_shard_step
    assert read_wire(data).layouts["w"].dev_matrix == (2,) == read_runtime(data).layouts["w"].dev_matrix
    same(data)


def test_last_number_wins_and_unknown_fields_and_groups_are_skipped() -> None:
    unknown = tag(9, 0) + varint(300) + tag(10, 1) + bytes(8) + tag(11, 5) + bytes(4) + delimited(12, b"xyz")
    group = tag(13, 3) + tag(1, 0) + b"\x05" + tag(14, 3) + tag(14, 4) + tag(13, 4)
    wrong_wire = tag(1, 5) + bytes(4)  # current_stage as fixed32: an unknown field for both readers
    data = tag(1, 0) + b"\x07" + unknown + group + wrong_wire + one_layout(layouts(delimited(1, b"\x02")))[2:]
    data += tag(1, 0) + b"\x02"
    assert read_wire(data).current_stage == 2 == read_runtime(data).current_stage
    same(data)


@pytest.mark.parametrize(
    "data",
    [
        tag(13, 3) + tag(1, 0) + b"\x05",  # a group never ended
        tag(13, 3) + tag(14, 4),  # ended by another number
        tag(13, 4),  # an end without a start
        tag(1, 6) + b"\x00",  # wire types 6 and 7 do not exist
        tag(0, 0) + b"\x00",  # field number 0
        tag(1, 0) + b"\x80" * 10 + b"\x01",  # a varint of 11 bytes
        tag(3, 2) + b"\x05ab",  # a payload past the end
    ],
)
def test_malformed_bytes_are_refused_by_both(data: bytes) -> None:
    with pytest.raises(WireError):
        read_wire(data)
    same(data)


def test_missing_required_fields_are_named_by_path(tmp_path: Path) -> None:
    no_field = one_layout(delimited(1, delimited(1, b"\x02")) + tag(6, 0) + b"\x00" + tag(7, 0) + b"\x00")
    with pytest.raises(WireError, match=r"missing required fields: parallel_layout_item\[0\]\.parallel_layouts\.field"):
        decode(no_field)
    with pytest.raises(WireError, match=r"missing required fields: current_stage$"):
        decode(b"")
    (tmp_path / "s.ckpt").write_bytes(no_field)
    with pytest.raises(FormatError, match=r"not a protobuf strategy file \(missing required fields: parallel_layout"):
        strategy.read_strategy(tmp_path / "s.ckpt")
    same(no_field)


def test_a_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s.ckpt").write_bytes(one_layout(layouts(delimited(1, b"\x02")), name=b"\xff"))
    with pytest.raises(FormatError, match="not valid UTF-8"):
        strategy.read_strategy(tmp_path / "s.ckpt")


def test_files_past_the_limit_go_to_the_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = strategy.encode_strategy(strategy.make_strategy({"w": strategy.ParamLayout((2, 4), (1, -1))}))
    (tmp_path / "s.ckpt").write_bytes(data)
    small = strategy.read_strategy(tmp_path / "s.ckpt")
    monkeypatch.setattr(strategy, "decode", lambda _: pytest.fail("the wire reader read a file past the limit"))
    monkeypatch.setattr(strategy, "WIRE_LIMIT", len(data) - 1)
    assert strategy.read_strategy(tmp_path / "s.ckpt") == small
    assert WIRE_LIMIT >= 32 * 1024


def test_reading_a_strategy_file_does_not_import_protobuf(tmp_path: Path) -> None:
    data = strategy.encode_strategy(strategy.make_strategy({"w": strategy.ParamLayout((2, 4), (1, -1))}))
    (tmp_path / "s.ckpt").write_bytes(data)
    code = (
        "import sys; from reshard.formats.strategy import read_strategy; "
        f"sf = read_strategy({str(tmp_path / 's.ckpt')!r}); "
        "assert sf.layouts['w'].tensor_map == (1, -1), sf; "
        "print(sorted(m for m in sys.modules if m.startswith('google')))"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == "[]"


def test_a_checkpoint_given_as_the_strategy_is_named(tmp_path: Path) -> None:
    """A user passing a rank's weights for the strategy: one line that says what the file is (both readers)."""
    from reshard.formats.ckpt import save_ckpt

    weights = tmp_path / "weights.ckpt"
    save_ckpt(str(weights), {"w": np.zeros((4, 4), "float32")})
    for limit in (WIRE_LIMIT, 0):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(strategy, "WIRE_LIMIT", limit)
            with pytest.raises(FormatError, match=r"looks like a checkpoint's weights \(\.ckpt\), not its strategy"):
                strategy.read_strategy(weights)
