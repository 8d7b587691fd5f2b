"""A hostile ``.metadata`` or ``data.pkl`` of a few KiB allocates a few hundred KiB at most before it is refused.

Each pickle below made the allowlisting unpickler allocate hundreds of MiB to GiB before it failed (a memo
index the C unpickler grows its memo array to, a counted length it allocates before reading, or an
allowed callable turning a string into a tuple per character or joining one part a thousand times).
They run in a child process whose address space is capped (``RLIMIT_AS``): structural, not timed. Each
must be refused with one ``FormatError`` line naming the file and what is wrong (a ``MemoryError``
caught on the way would not do). Then: pickles that Python's own ``pickle.dump`` writes for the values
DCP records hold pass the opcode check at every protocol, and a seeded fuzzer of random opcode streams
(lying lengths and indices included) stays inside ``tests/test_fuzz_readers.py``'s memory bound.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.errors import FormatError, ReshardError
from reshard.formats import dcp
from reshard.formats.dcp.opcodes import check_opcodes
from tests.test_fuzz_readers import bounded

ROOT = Path(__file__).resolve().parent.parent
ADDRESS_SPACE = 400 * 1024 * 1024
# numpy's BLAS starts a thread per core at import, each with its own stack: on a big machine that alone
# would take the capped address space
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SEEDED = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _binget(index: int) -> bytes:
    return b"h" + bytes([index])


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def size_of_a_string_grown_by_str() -> bytes:
    """``torch.Size`` was ``tuple``, ``_get_layout`` was ``str``: tuple(str(tuple(str(...)))) grows ~5x a round."""
    out = b"\x80\x02" + _global("torch", "Size") + b"q\x00" + _global("torch.serialization", "_get_layout") + b"q\x01"
    out += _text("\u30a2" * 64) + b"q\x02"
    for _ in range(14):
        out += _binget(1) + _binget(0) + _binget(2) + b"\x85R\x85R" + b"q\x020"  # x = str(tuple(x))
    return out + b"N."


def a_path_of_one_part_a_thousand_times() -> bytes:
    out = b"\x80\x02" + _global("pathlib", "PosixPath") + b"q\x00" + _text("p" * 1000) + b"q\x01"
    out += b"0(" + _binget(1) * 1000 + b"tq\x02"
    out += (_binget(0) + _binget(2) + b"R") * 500  # each call joins 1 MB, each kept on the stack
    return out + b"N."


HOSTILE = {
    "LONG_BINPUT": (b"\x80\x02K\x01r\x00\x00\x00\x10.", "memo index 268435456"),  # the memo grown to 4 GiB
    "PUT": (b"K\x01p300000000\n.", "memo index 300000000"),
    "BINBYTES": (b"\x80\x03B\x00\x00\x00\x40abc.", "declares 1073741824 bytes where 4 are left"),
    "BINBYTES8": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 30) + b"abc.", "BINBYTES8 at byte 2 declares"),
    "BYTEARRAY8": (b"\x80\x05\x96" + struct.pack("<Q", 1 << 30) + b"abc.", "opcode 0x96 at byte 2"),
    "FRAME": (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"K\x01.", "FRAME at byte 2 declares"),
    "EMPTY_SET": (b"\x80\x04" + b"\x8f" * 64 + b".", "opcode 0x8f at byte 2"),
    "torch.Size of a string": (size_of_a_string_grown_by_str(), "torch.Size of a str"),
    "a path part repeated": (a_path_of_one_part_a_thousand_times(), "paths longer, together, than the pickle"),
}

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from reshard.errors import ReshardError
from reshard.formats import dcp
out = {{}}
for name in json.loads(sys.argv[1]):
    try:
        dcp.read_dcp_metadata(sys.argv[2] + "/" + name)
        out[name] = "read"
    except ReshardError as exc:
        out[name] = str(exc)
    except MemoryError:
        out[name] = "MemoryError"
print(json.dumps(out))
"""


def test_hostile_pickles_are_refused_in_a_capped_address_space(tmp_path: Path) -> None:
    for i, (data, _) in enumerate(HOSTILE.values()):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / ".metadata").write_bytes(data)
    names = [str(i) for i in range(len(HOSTILE))]
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(limit=ADDRESS_SPACE), json.dumps(names), str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", **ONE_THREAD},
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    for i, (what, (data, message)) in enumerate(HOSTILE.items()):
        assert len(data) < 8192, what
        assert message in got[str(i)], (what, got[str(i)])
        assert got[str(i)].startswith(f"{tmp_path / str(i) / '.metadata'}: the metadata pickle is not a DCP pickle")
        assert "\n" not in got[str(i)]


@pytest.mark.parametrize("what", list(HOSTILE))
def test_each_hostile_pickle_allocates_little(tmp_path: Path, what: str) -> None:
    data, message = HOSTILE[what]
    (tmp_path / ".metadata").write_bytes(data)
    with bounded(len(data)), pytest.raises(FormatError, match=message):
        dcp.read_dcp_metadata(tmp_path)


def test_a_dtype_cannot_be_rewritten_by_build(tmp_path: Path) -> None:
    """BUILD on a shared dtype value (one per name) must not change it for the next read."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + _global("torch", "float32") + b"}X\x04\x00\x00\x00nameK\x01sb.")
    with pytest.raises(FormatError, match="state given to a _TorchDtype, which no DCP pickle does"):
        dcp.read_dcp_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(
        b"\x80\x02" + _global("torch", "float32") + b"N}X\x04\x00\x00\x00nameK\x01s\x86b."
    )
    with pytest.raises(FormatError, match="state given to a _TorchDtype, which no DCP pickle does"):
        dcp.read_dcp_metadata(tmp_path)
    from reshard.formats.dcp.unpickling import _TORCH_DTYPES

    assert _TORCH_DTYPES["float32"].name == "float32"


def test_a_path_within_the_budget_reads() -> None:
    from reshard.formats.dcp.unpickling import _MetadataUnpickler, _unpickle

    data = b"\x80\x02" + _global("pathlib", "PosixPath") + _text("ckpt") + _text("step_1") + b"\x86R."
    assert _unpickle(_MetadataUnpickler, data, "m", "the metadata pickle") == "ckpt/step_1"


# ------------------------------------------------------------------------ what pickle.dump writes passes

VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**71), 2**71 - 1)  # 9 bytes at most (DCP's are int64)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=5) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=40,
)


@SEEDED
@given(value=VALUES, protocol=st.integers(0, 5))
def test_what_pickle_dump_writes_passes_the_opcode_check(value: object, protocol: int) -> None:
    check_opcodes(pickle.dumps(value, protocol=protocol))
    check_opcodes(pickle.dumps([value, value, [value]], protocol=protocol))  # memoised references


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_integers_of_one_hash_are_refused(protocol: int) -> None:
    """hash(k * (2**61 - 1)) is 0 for every k: a dict of 3 000 of them takes seconds to build, 30 000 minutes."""
    keys = {k * (2**61 - 1): None for k in range(1, 3000)}
    assert {hash(k) for k in keys} == {0}
    with pytest.raises(pickle.UnpicklingError, match="wider than any DCP pickle holds"):
        check_opcodes(pickle.dumps(keys, protocol=protocol))
    check_opcodes(pickle.dumps([2**71 - 1, -(2**71), 2**63], protocol=protocol))


@pytest.mark.parametrize("value", [{1, 2}, frozenset({3}), bytearray(b"x" * 10)])
def test_sets_and_bytearrays_are_refused(value: object) -> None:
    with pytest.raises(pickle.UnpicklingError, match="which no DCP pickle writes"):
        check_opcodes(pickle.dumps(value, protocol=5))


def test_the_real_seed_pickles_pass(tmp_path: Path) -> None:
    from tests.test_dcp_format import sample

    tensors, files, values = sample()
    dcp.save_dcp(tmp_path / "ckpt", tensors, files, values)
    check_opcodes((tmp_path / "ckpt" / ".metadata").read_bytes())
    assert len(dcp.read_dcp_metadata(tmp_path / "ckpt").tensors) == len(tensors)


# ------------------------------------------------------------------------ random opcode streams

NUMBERS = st.sampled_from([0, 1, 2, 255, 256, 2**16, 2**31 - 1, 2**32 - 1, 2**40, 2**63]) | st.integers(0, 2**32)
OPCODES = st.sampled_from(sorted({op.code.encode("latin-1") for op in __import__("pickletools").opcodes}))


@st.composite
def opcode_streams(draw: st.DrawFn) -> bytes:
    """Random opcodes with arguments of random (often lying) sizes, and a STOP."""
    out = bytearray(b"\x80" + bytes([draw(st.integers(2, 5))]))
    for _ in range(draw(st.integers(0, 40))):
        out += draw(OPCODES)
        kind = draw(st.sampled_from(["none", "byte", "u32", "u64", "line", "text"]))
        if kind == "byte":
            out += bytes([draw(st.integers(0, 255))])
        elif kind == "u32":
            out += struct.pack("<I", draw(NUMBERS) % 2**32)
        elif kind == "u64":
            out += struct.pack("<Q", draw(NUMBERS) % 2**64)
        elif kind == "line":
            out += str(draw(NUMBERS)).encode() + b"\n"
        elif kind == "text":
            out += draw(st.sampled_from([b"torch\nSize\n", b"pathlib\nPath\n", b"abc", b"\x8c\x01a"]))
    return bytes(out + b".")


@SEEDED
@given(data=opcode_streams())
def test_random_opcode_streams_stay_bounded(tmp_path: Path, data: bytes) -> None:
    (tmp_path / ".metadata").write_bytes(data)
    with bounded(len(data)), contextlib.suppress(ReshardError):
        dcp.read_dcp_metadata(tmp_path)


def test_the_cli_refuses_a_hostile_metadata_in_one_line(tmp_path: Path) -> None:
    from tests.trust_helpers import run_cli

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(HOSTILE["LONG_BINPUT"][0])
    (folder / "__0_0.distcp").write_bytes(b"")
    for command in (["inspect", str(folder)], ["transform", str(folder), str(tmp_path / "out")]):
        done = run_cli(*command)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and str(folder / ".metadata") in lines[0] and "memo index 268435456" in lines[0]
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["LONG_BINPUT", "PUT", "BINBYTES8", "FRAME"])
def test_a_hostile_data_pkl_allocates_little(tmp_path: Path, what: str) -> None:
    from tests.test_dcp_format import archive, folder_with_chunk

    data, message = HOSTILE[what]
    folder = folder_with_chunk(tmp_path, archive(data, bytes(24)))
    meta = dcp.read_dcp_metadata(folder)
    with bounded(len(data)), pytest.raises(FormatError, match=message):
        dcp.index_distcp(meta, "__0_0.distcp").close()
