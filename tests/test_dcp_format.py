"""The DCP reader and writer without torch: round trips, the ZIP archives, and every refusal.

Hostile pickles (in ``.metadata`` and in a chunk's ``data.pkl``) are refused naming the global, with
nothing run; truncated files, missing files, chunks outside their tensor, overlapping or leaving a
gap, stream transforms, non-contiguous views and compressed storage members are one ``ReshardError``
line each. Mutated files (a little fuzzing, with ``tests/test_fuzz_readers.py``'s time and memory
bound) end in a ``ReshardError`` or a successful read. ``src/reshard`` never imports torch.
"""

from __future__ import annotations

import ast
import contextlib
import io
import pickle
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.errors import FormatError, ReshardError, UnsupportedError, UsageError
from reshard.formats import dcp
from reshard.formats.dcp import BytesItem, Chunk, ChunkSpec, TensorMeta
from tests.test_fuzz_readers import bounded  # a time and allocation bound per example

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(  # seeded: the same examples every run (tests/test_unpickle_bounds.py has the hostile ones)
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def spec(fqn: str, arr: np.ndarray, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkSpec:
    return ChunkSpec(fqn, dtypes.from_numpy(arr.dtype), tuple(arr.shape), offsets, sizes)


def sample() -> tuple[dict[str, np.ndarray], dict[str, list[ChunkSpec | str]], dict[str, bytes]]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    b = rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    c = np.arange(5, dtype=np.int64)
    f8 = np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3fn)
    z = np.array(2.5, dtype=np.float16)
    e = np.zeros((0, 3), dtype=np.float32)
    tensors = {"a": a, "b": b, "c": c, "f8": f8, "z": z, "e": e}
    files: dict[str, list[ChunkSpec | str]] = {
        "__0_0.distcp": [spec("a", a, (0, 0), (4, 5)), spec("b", b, (0, 0), (4, 2)), spec("c", c, (0,), (5,)), "step"],
        "__1_0.distcp": [
            spec("a", a, (4, 0), (3, 5)),
            spec("b", b, (0, 2), (4, 4)),
            spec("f8", f8, (0,), (8,)),
            spec("z", z, (), ()),
            spec("e", e, (0, 0), (0, 3)),
        ],
    }
    return tensors, files, {"step": b"opaque torch.save bytes \x00\x01"}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tensors, files, values = sample()
    dcp.save_dcp(tmp_path / "ckpt", tensors, files, values)
    return tmp_path / "ckpt"


def whole(meta: dcp.DcpMetadata) -> dict[str, np.ndarray]:
    out = {fqn: np.zeros(t.shape, dtype=t.dtype.carrier) for fqn, t in meta.tensors.items()}
    for rel in meta.files:
        with dcp.index_distcp(meta, rel) as index:
            for t in meta.tensors.values():
                for c in t.chunks:
                    if c.file == rel:
                        out[t.fqn][tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = (
                            index.items(c.name)
                        )
    return out


def test_round_trip(saved: Path) -> None:
    tensors, _, values = sample()
    meta = dcp.read_dcp_metadata(saved)
    assert [t.dtype for t in meta.tensors.values()] == [
        dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.INT64, dtypes.FLOAT8_E4M3, dtypes.FLOAT16, dtypes.FLOAT32,
    ]  # fmt: skip
    got = whole(meta)
    for fqn, arr in tensors.items():
        assert got[fqn].tobytes() == arr.tobytes(), fqn
    assert dcp.read_bytes_item(meta, "step") == values["step"]
    assert meta.byte_items["step"] == BytesItem("step", "__0_0.distcp", 0, len(values["step"]))
    assert meta.planner_data == {fqn: (fqn,) for fqn in [*tensors, "step"]}
    assert meta.version == dcp.DCP_VERSION
    assert not (saved / ".metadata.tmp").exists()
    assert {dcp.serialization_of(meta, rel) for rel in meta.files} == {dcp.TORCH_SAVE}


def test_a_data_file_opens_by_its_path(saved: Path) -> None:
    with dcp.open_distcp(saved / "__1_0.distcp") as index:
        assert list(index) == ["a@4,0", "b@0,2", "f8@0", "z@", "e@0,0"]
        assert index.file_backed and index.format == dcp.FORMAT
    with pytest.raises(FormatError, match="names no chunk or value in it"):
        (saved / "__9_0.distcp").write_bytes(b"")
        dcp.open_distcp(saved / "__9_0.distcp")
    with pytest.raises(FormatError, match=r"no \.metadata beside it"):
        dcp.open_distcp(saved.parent / "elsewhere.distcp")


def test_written_twice_is_byte_identical(tmp_path: Path) -> None:
    tensors, files, values = sample()
    for name in ("one", "two"):
        dcp.save_dcp(tmp_path / name, tensors, files, values)
    for rel in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes()


def test_chunks_are_valid_zip_archives_as_torch_writes_them(saved: Path) -> None:
    meta = dcp.read_dcp_metadata(saved)
    chunk = meta.tensors["a"].chunks[1]
    raw = (saved / chunk.file).read_bytes()[chunk.offset : chunk.offset + chunk.length]
    archive = zipfile.ZipFile(io.BytesIO(raw))
    assert archive.testzip() is None  # every CRC-32 right, data/0's patched in after the data
    names = [i.filename for i in archive.infolist()]
    assert names[:5] == [
        f"archive/{n}" for n in ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0")
    ]
    assert archive.read("archive/byteorder") == b"little" and archive.read("archive/version") == b"3\n"
    info = archive.getinfo("archive/data/0")
    assert info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    assert start % 64 == 0  # torch.save's storage alignment


def test_zip64_records_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp.write, "_ZIP64_AT", 0)
    tensors, files, values = sample()
    meta = dcp.save_dcp(tmp_path / "z", tensors, files, values)
    chunk = meta.tensors["a"].chunks[0]
    raw = (tmp_path / "z" / chunk.file).read_bytes()[chunk.offset : chunk.offset + chunk.length]
    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
    assert all(whole(meta)[k].tobytes() == v.tobytes() for k, v in tensors.items())


def test_tensor_pickle_names_torch_globals() -> None:
    typed = dcp.tensor_pickle(dtypes.BFLOAT16, (4, 3))
    assert b"ctorch._utils\n_rebuild_tensor_v2\n" in typed and b"ctorch\nBFloat16Storage\n" in typed
    untyped = dcp.tensor_pickle(dtypes.FLOAT8_E4M3, (8,))
    assert b"_rebuild_tensor_v3" in untyped and b"UntypedStorage" in untyped and b"ctorch\nfloat8_e4m3fn\n" in untyped


def test_torch_dtype_names() -> None:
    assert dtypes.from_torch_name("bfloat16") is dtypes.BFLOAT16
    assert dtypes.torch_name(dtypes.FLOAT8_E4M3) == "float8_e4m3fn"
    with pytest.raises(FormatError, match="quint8"):
        dtypes.from_torch_name("quint8")
    with pytest.raises(UsageError):
        dtypes.torch_name(dtypes.INT4)


# ----------------------------------------------------------------------------------- refusals


def hostile(command: str) -> bytes:
    """A pickle that would run ``os.system(command)`` if loaded by pickle.load."""
    return b"cos\nsystem\n(" + pickle.dumps(command, protocol=0)[:-1] + b"tR."


def test_hostile_metadata_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(hostile(f"touch {marker}"))
    with pytest.raises(FormatError, match=r"\.metadata: the metadata pickle names os\.system, .*refused"):
        dcp.read_dcp_metadata(folder)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cbuiltins\neval\n(S'1'\ntR.",
        b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04exec\x93.",
        b"ctorch.distributed.checkpoint.metadata\nMetadata.__init__.__globals__\n.",
        b"cposix\nsystem\n.",
    ],
)
def test_other_globals_are_refused(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(FormatError, match="refused, nothing run"):
        dcp.read_dcp_metadata(tmp_path)


def archive(pkl: bytes, storage: bytes, *, compress: bool = False) -> bytes:
    out = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/data/0", storage, compress_type=method)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def folder_with_chunk(
    tmp_path: Path, data: bytes, shape: tuple[int, ...] = (2, 3), dtype: dtypes.DType = dtypes.FLOAT32
) -> Path:
    """A checkpoint of one tensor stored as one chunk whose item is ``data``."""
    folder = tmp_path / "one"
    folder.mkdir(exist_ok=True)
    (folder / "__0_0.distcp").write_bytes(data)
    chunk = Chunk("w", (0,) * len(shape), shape, "__0_0.distcp", 0, len(data))
    dcp.write_metadata(folder, [TensorMeta("w", dtype, shape, (chunk,))])
    return folder


def test_a_hand_made_torch_save_archive_reads(tmp_path: Path) -> None:
    values = np.arange(6, dtype=np.float32)
    folder = folder_with_chunk(tmp_path, archive(dcp.tensor_pickle(dtypes.FLOAT32, (2, 3)), values.tobytes()))
    meta = dcp.read_dcp_metadata(folder)
    assert whole(meta)["w"].tobytes() == values.tobytes()


def test_a_view_into_a_larger_storage_reads(tmp_path: Path) -> None:
    storage = np.arange(10, dtype=np.float32)
    pkl = dcp.tensor_pickle(dtypes.FLOAT32, (2, 3)).replace(b"K\x06tQK\x00", b"K\x0atQK\x02")  # offset 2 of 10
    folder = folder_with_chunk(tmp_path, archive(pkl, storage.tobytes()))
    assert whole(dcp.read_dcp_metadata(folder))["w"].tobytes() == storage[2:8].tobytes()
    pkl = pkl.replace(b"K\x0atQK\x02", b"K\x0atQK\x05")  # offset 5: 6 elements do not fit in 10
    folder = folder_with_chunk(tmp_path, archive(pkl, storage.tobytes()))
    with pytest.raises(FormatError, match="views bytes outside its storage"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")


def test_hostile_data_pkl_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = folder_with_chunk(tmp_path, archive(hostile(f"touch {marker}"), bytes(24)))
    meta = dcp.read_dcp_metadata(folder)
    with pytest.raises(FormatError, match=r"__0_0\.distcp: the data.pkl of chunk 'w@0,0' .* names os\.system"):
        dcp.index_distcp(meta, "__0_0.distcp")
    assert not marker.exists()


def test_non_contiguous_view_is_refused(tmp_path: Path) -> None:
    pkl = dcp.tensor_pickle(dtypes.FLOAT32, (2, 3)).replace(b"(K\x03K\x01t", b"(K\x01K\x02t")  # a transposed view
    folder = folder_with_chunk(tmp_path, archive(pkl, bytes(24)))
    with pytest.raises(UnsupportedError, match=r"non-contiguous view \(strides \[1, 2\]\)"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")


def test_compressed_storage_is_refused(tmp_path: Path) -> None:
    folder = folder_with_chunk(tmp_path, archive(dcp.tensor_pickle(dtypes.FLOAT32, (2, 3)), bytes(24), compress=True))
    with pytest.raises(FormatError, match="compressed storage member"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")


def test_dtype_and_shape_must_match_the_metadata(tmp_path: Path) -> None:
    folder = folder_with_chunk(
        tmp_path, archive(dcp.tensor_pickle(dtypes.FLOAT32, (2, 3)), bytes(24)), dtype=dtypes.INT32
    )
    with pytest.raises(FormatError, match="holds float32, the metadata says int32"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")
    folder = folder_with_chunk(tmp_path, archive(dcp.tensor_pickle(dtypes.FLOAT32, (3, 2)), bytes(24)))
    with pytest.raises(FormatError, match=r"shape \[3, 2\], the metadata says \[2, 3\]"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")


def test_not_an_archive(tmp_path: Path) -> None:
    folder = folder_with_chunk(tmp_path, b"PK\x03\x04" + bytes(60))
    with pytest.raises(FormatError, match=r"is not a torch\.save archive"):
        dcp.index_distcp(dcp.read_dcp_metadata(folder), "__0_0.distcp")


def test_truncated_data_file(saved: Path) -> None:
    data = saved / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(FormatError, match=r"__1_0\.distcp: .* but the file has \d+ bytes \(truncated\)"):
        dcp.read_dcp_metadata(saved)


def test_missing_data_file(saved: Path) -> None:
    (saved / "__0_0.distcp").unlink()
    with pytest.raises(FormatError, match=r"\.metadata: data file '__0_0\.distcp' named by the metadata is missing"):
        dcp.read_dcp_metadata(saved)


def test_missing_metadata(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"\.metadata: cannot read"):
        dcp.read_dcp_metadata(tmp_path)


def boxes_metadata(
    tmp_path: Path, boxes: list[tuple[tuple[int, int], tuple[int, int]]], *, transforms: tuple[str, ...] = ()
) -> Path:
    """A checkpoint of a 4x4 float32 tensor with chunks ``boxes`` (bytes present), unchecked at writing."""
    (tmp_path / "__0_0.distcp").write_bytes(bytes(1024))
    chunks = tuple(Chunk("w", o, s, "__0_0.distcp", 0, 64, transforms) for o, s in boxes)
    (tmp_path / ".metadata").write_bytes(dcp.metadata_pickle([TensorMeta("w", dtypes.FLOAT32, (4, 4), chunks)], []))
    return tmp_path


def test_chunk_outside_the_tensor(tmp_path: Path) -> None:
    boxes_metadata(tmp_path, [((0, 0), (4, 4)), ((2, 3), (2, 2))])
    with pytest.raises(FormatError, match=r"'w' chunk at \[2, 3\] of \[2, 2\] lies outside its shape \[4, 4\]"):
        dcp.read_dcp_metadata(tmp_path)


def test_overlapping_chunks(tmp_path: Path) -> None:
    boxes_metadata(tmp_path, [((0, 0), (3, 4)), ((2, 0), (2, 4))])
    with pytest.raises(FormatError, match=r"'w' chunk at \[2, 0\] overlaps another chunk"):
        dcp.read_dcp_metadata(tmp_path)


def test_overlap_found_on_the_grid(tmp_path: Path) -> None:
    boxes_metadata(tmp_path, [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 1), (2, 2))])  # cut along both axes
    with pytest.raises(FormatError, match=r"'w' chunk at \[1, 1\] overlaps another chunk"):
        dcp.read_dcp_metadata(tmp_path)


def test_a_scalar_in_two_chunks(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(bytes(64))
    chunks = tuple(Chunk("s", (), (), "__0_0.distcp", 0, 4) for _ in range(2))
    (tmp_path / ".metadata").write_bytes(dcp.metadata_pickle([TensorMeta("s", dtypes.FLOAT32, (), chunks)], []))
    with pytest.raises(FormatError, match="'s' has 2 chunks of its one element"):
        dcp.read_dcp_metadata(tmp_path)


def test_overlap_found_without_the_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp.metadata, "_GRID_CELLS", 1)
    boxes_metadata(tmp_path, [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 1), (2, 2))])
    with pytest.raises(FormatError, match="overlaps another chunk"):
        dcp.read_dcp_metadata(tmp_path)


def test_chunks_leaving_a_gap(tmp_path: Path) -> None:
    boxes_metadata(tmp_path, [((0, 0), (2, 4)), ((2, 0), (2, 2))])
    with pytest.raises(FormatError, match=r"its chunks do not cover it \(12 of 16 elements\)"):
        dcp.read_dcp_metadata(tmp_path)


def test_stream_transforms_are_refused(tmp_path: Path) -> None:
    boxes_metadata(tmp_path, [((0, 0), (4, 4))], transforms=("zstd",))
    with pytest.raises(UnsupportedError, match=r"stream transforms \['zstd'\]"):
        dcp.read_dcp_metadata(tmp_path)


def test_paths_outside_the_folder_are_refused(tmp_path: Path) -> None:
    chunk = Chunk("w", (0,), (2,), "../elsewhere.distcp", 0, 8)
    (tmp_path / ".metadata").write_bytes(dcp.metadata_pickle([TensorMeta("w", dtypes.FLOAT32, (2,), (chunk,))], []))
    with pytest.raises(FormatError, match="is not a path inside the checkpoint folder"):
        dcp.read_dcp_metadata(tmp_path)
    with pytest.raises(UsageError):
        dcp.distcp_layout("/abs.distcp", [])


def test_writer_refuses_a_chunk_outside_its_tensor() -> None:
    with pytest.raises(UsageError, match="does not fit"):
        dcp.distcp_layout("__0_0.distcp", [ChunkSpec("w", dtypes.FLOAT32, (2, 2), (1, 0), (2, 2))])


# ------------------------------------------------------------------------------------- fuzzing


@FUZZ
@given(data=st.data())
def test_fuzz_metadata(saved: Path, data: st.DataObject) -> None:
    original = (saved / ".metadata").read_bytes()
    mutated = mutate(original, data)
    (saved / ".metadata").write_bytes(mutated)
    try:
        with bounded(len(mutated)), contextlib.suppress(ReshardError):
            meta = dcp.read_dcp_metadata(saved)
            for rel in meta.files:
                dcp.index_distcp(meta, rel).close()
    finally:
        (saved / ".metadata").write_bytes(original)


@FUZZ
@given(data=st.data())
def test_fuzz_data_file(saved: Path, data: st.DataObject) -> None:
    path = saved / "__1_0.distcp"
    original = path.read_bytes()
    mutated = mutate(original, data)
    path.write_bytes(mutated)
    try:
        with bounded(len(mutated)), contextlib.suppress(ReshardError):
            meta = dcp.read_dcp_metadata(saved)
            with dcp.index_distcp(meta, "__1_0.distcp") as index:
                for name in index:
                    index.items(name).sum()
    finally:
        path.write_bytes(original)


def mutate(raw: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "overwrite"]))
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    at = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        return raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1 :]
    junk = data.draw(st.binary(min_size=1, max_size=8))
    return raw[:at] + junk + raw[at + len(junk) :]


# -------------------------------------------------------------------------------- no torch inside


def test_reshard_never_imports_torch() -> None:
    for path in sorted((ROOT / "src" / "reshard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n == "torch" or n.startswith("torch.")], f"{path} imports torch"


# ----------------------------------------------------------------------------- chunk tables


def test_chunk_tables_match_the_records(saved: Path) -> None:
    meta = dcp.read_dcp_metadata(saved)
    for fqn, tensor in meta.tensors.items():
        table = tensor.table
        assert len(table) == tensor.chunk_count == len(tensor.chunks)
        assert tensor.chunks == table.chunks(fqn) == tuple(table.chunk(fqn, k) for k in range(len(table)))
        again = dcp.ChunkTable.of(tensor.chunks, len(tensor.shape))
        for column in ("offsets", "sizes", "file_ids", "starts", "lengths"):
            assert np.array_equal(getattr(again, column), getattr(table, column)), (fqn, column)
        assert TensorMeta(fqn, tensor.dtype, tensor.shape, tensor.chunks) == tensor
        for rel in meta.files:
            assert [c.file for c in tensor.chunks if c.file == rel] == [rel] * len(table.rows_in(rel))
    for rel in meta.files:
        listed = [(t.fqn, t.table.chunk(t.fqn, int(k))) for t, rows in meta.chunks_in(rel) for k in rows]
        assert listed == [(t.fqn, c) for t in meta.tensors.values() for c in t.chunks if c.file == rel]
    assert meta.chunks_in("__7_0.distcp") == []
    assert pickle.loads(pickle.dumps(meta)) == meta  # as Ray and multiprocessing ship it
    with pytest.raises(AttributeError, match="frozen"):
        meta.tensors["a"].fqn = "b"  # type: ignore[misc]


def test_a_mesh_tiling_is_checked_cell_by_cell(tmp_path: Path) -> None:
    mesh = [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]  # Shard(0) x Shard(1): one grid cell each
    boxes_metadata(tmp_path, mesh)
    assert len(dcp.read_dcp_metadata(tmp_path).tensors["w"].chunks) == 4
    boxes_metadata(tmp_path, [*mesh[:3], ((0, 2), (2, 2))])  # the third cell twice, the last one missing
    with pytest.raises(FormatError, match=r"'w' chunk at \[0, 2\] overlaps another chunk"):
        dcp.read_dcp_metadata(tmp_path)


def test_a_huge_length_in_the_pickle_allocates_nothing(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"\x80\x02X\xff\xff\xff\x7fabc")  # a 2 GiB string of 3 bytes
    with bounded(64), pytest.raises(FormatError, match="not a DCP pickle"):
        dcp.read_dcp_metadata(tmp_path)
