"""``--output-format dcp`` without torch: the plan (chunks are the source slices, nothing merged),
``reshard plan`` printing it, the ``.metadata`` written last, the chunkings, and the refusals.

What torch makes of the outputs is ``tests/test_dcp_write_oracle.py``'s; here reshard's own DCP
reader (``formats.dcp``) reads them back, and each tensor must equal the full model's bytes.
"""

from __future__ import annotations

import io
import os
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest

from reshard import api, interrupts, statenames
from reshard.formats import dcp
from reshard.formats.ckpt import read_ckpt
from reshard.formats.distcp_format import DISTCP, parse_chunk_name
from reshard.layout.chunks import even_boxes
from reshard.plan.dcp import cut
from reshard.plan.model import Copy, TensorPlan
from tests.test_integrity_signals import run_paused
from tests.trust_helpers import make_job, run_cli, temp_files

DCP = api.OutputSpec(format="dcp")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("dcpwrite")))


def full_tensors(path: str) -> dict[str, np.ndarray]:
    index = read_ckpt(path)
    return {n: np.array(index.array(n)) for n, e in index.entries.items() if e.dtype.ms_name != "String"}


def read_back(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a DCP folder whole, from reshard's own reader (as bytes of the stored dtype)."""
    meta = dcp.read_dcp_metadata(folder)
    out = {fqn: np.zeros(t.shape, dtype=t.dtype.carrier) for fqn, t in meta.tensors.items()}
    seen = {fqn: 0 for fqn in meta.tensors}
    for rel in meta.files:
        with dcp.index_distcp(meta, rel) as index:
            for tensor in meta.tensors.values():
                for chunk in tensor.chunks:
                    if chunk.file == rel:
                        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
                        out[tensor.fqn][box] = index.items(chunk.name)
                        seen[tensor.fqn] += chunk.numel
    assert all(seen[f] == int(np.prod(meta.tensors[f].shape)) for f in seen)  # each element once
    return out


def assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].tobytes() == value.tobytes(), name


def test_chunks_are_the_source_slices_nothing_merged(job: dict[str, str], tmp_path: Path) -> None:
    report = api.transform(job["r8"], str(tmp_path / "d"), job["s8"], None, output=DCP)
    plan = report.plan
    assert [os.path.basename(f.path) for f in plan.files] == [f"__{r}_0.distcp" for r in range(8)]
    assert [os.path.basename(t.path) for t in plan.texts] == [".metadata"]
    for f in plan.files:
        assert f.format == "distcp"
        for t in f.tensors:
            (c,) = t.copies  # one source slice, copied whole: never merged first
            assert c.whole_source and c.lengths == t.shape
            assert os.path.basename(os.path.dirname(plan.sources[c.source])) == f"rank_{f.rank}"
            assert parse_chunk_name(t.name)[0] == c.tensor
    assert plan.bytes_read == plan.bytes_written  # one read and one write of each byte
    assert_equal(read_back(str(tmp_path / "d")), full_tensors(job["full"]))
    assert "passed over" not in " ".join(report.notes) or "string" in " ".join(report.notes)


@pytest.mark.parametrize("manifest", [True, False])
@pytest.mark.parametrize("ranks", [1, 3])
def test_zip_crcs_are_patched(job: dict[str, str], tmp_path: Path, manifest: bool, ranks: int) -> None:
    """Each archive's CRC-32s are sealed as its chunk is written (``ByteLayout.seal``), on tensor worker
    threads too, and the file hashed while written has the checksum the manifest records."""
    from tests.test_dcp_resume import assert_manifest_matches

    out = api.OutputSpec(format="dcp", dcp_ranks=ranks)
    dst = tmp_path / "d"
    api.transform(job["full"], str(dst), None, None, output=out, destination=api.Destination(manifest=manifest))
    meta = dcp.read_dcp_metadata(str(dst))
    files = {c.file: (dst / c.file).read_bytes() for t in meta.tensors.values() for c in t.chunks}
    for tensor in meta.tensors.values():
        for chunk in tensor.chunks:
            data = files[chunk.file]
            archive = zipfile.ZipFile(io.BytesIO(data[chunk.offset : chunk.offset + chunk.length]))
            assert archive.testzip() is None  # every member's CRC-32 matches its bytes
    if manifest:
        assert_manifest_matches(str(dst))


def test_even_rows_and_strategy_boxes(job: dict[str, str], tmp_path: Path) -> None:
    api.transform(job["full"], str(tmp_path / "e"), None, None, output=api.OutputSpec(format="dcp", dcp_ranks=3))
    meta = dcp.read_dcp_metadata(str(tmp_path / "e"))
    for tensor in meta.tensors.values():
        if tensor.shape and tensor.shape[0]:
            want = [b for b in even_boxes(tensor.shape, 0, 3) if b[0][0] < b[0][1]]
            got = [tuple((o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True)) for c in tensor.chunks]
            assert got == want, tensor.fqn
    assert_equal(read_back(str(tmp_path / "e")), full_tensors(job["full"]))
    report = api.split(job["full"], job["s4"], str(tmp_path / "s"), output=DCP)
    assert [f.rank for f in report.plan.files] == [0, 1, 2, 3]
    assert_equal(read_back(str(tmp_path / "s")), full_tensors(job["full"]))
    report = api.transform(job["r8"], str(tmp_path / "t"), job["s8"], job["s4"], output=DCP)
    assert [f.rank for f in report.plan.files] == [0, 1, 2, 3]  # the destination strategy's boxes
    assert_equal(read_back(str(tmp_path / "t")), full_tensors(job["full"]))
    api.convert(job["full"], str(tmp_path / "c"), "dcp")
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp", "reshard-manifest.json"]
    assert_equal(read_back(str(tmp_path / "c")), full_tensors(job["full"]))


def test_a_cast_writes_the_cast_dtype(job: dict[str, str], tmp_path: Path) -> None:
    api.transform(job["r8"], str(tmp_path / "b"), job["s8"], None, output=DCP, tensors=api.TensorOptions(dtype="bf16"))
    meta = dcp.read_dcp_metadata(str(tmp_path / "b"))
    weights = {t.dtype.ms_name for f, t in meta.tensors.items() if not statenames.DEFAULT.is_state(f)}
    assert weights == {"BFloat16"}  # the weights; the training state keeps its dtypes, as --dtype does


def test_cut_moves_the_source_start_along_permuted_axes() -> None:
    from reshard import dtypes

    copy = Copy(0, "w", (0, 0), (0, 0), (4, 6), src_perm=(1, 0))  # destination (4, 6) is the source transposed
    t = TensorPlan("w", dtypes.FLOAT32, (4, 6), (copy,), 96)
    part = cut(t, ((2, 4), (3, 6)), "w@2,3")
    (c,) = part.copies
    assert (c.src_start, c.dst_start, c.lengths, c.whole_source) == ((3, 2), (0, 0), (2, 3), False)


def test_an_empty_tensor_is_one_empty_chunk(tmp_path: Path) -> None:
    from reshard.formats.safetensors import save_safetensors

    save_safetensors(str(tmp_path / "m.safetensors"), {"e": np.zeros((0, 4), np.float32), "w": np.ones(3, np.float32)})
    api.transform(str(tmp_path / "m.safetensors"), str(tmp_path / "d"), None, None, output=DCP)
    meta = dcp.read_dcp_metadata(str(tmp_path / "d"))
    assert [(c.offsets, c.sizes) for c in meta.tensors["e"].chunks] == [((0, 0), (0, 4))]


def test_plan_prints_the_data_files_and_metadata(job: dict[str, str], tmp_path: Path) -> None:
    proc = run_cli("plan", job["r8"], str(tmp_path / "p"), "--src-strategy", job["s8"], "--output-format", "dcp")
    assert proc.returncode == 0, proc.stderr
    assert "__7_0.distcp" in proc.stdout and "distcp" in proc.stdout
    proc = run_cli(
        "plan", job["r8"], str(tmp_path / "p"), "--src-strategy", job["s8"], "--output-format", "dcp", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert ".metadata" in proc.stdout
    assert not (tmp_path / "p").exists()


def test_metadata_is_written_last(job: dict[str, str], tmp_path: Path) -> None:
    dst = str(tmp_path / "d")
    args = ["transform", job["r8"], dst, "--src-strategy", job["s8"], "--output-format", "dcp", "--workers", "1"]
    proc = run_paused(args, "file:8", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    assert not os.path.exists(os.path.join(dst, ".metadata"))  # seven data files, no checkpoint yet
    assert not temp_files(dst)
    proc = run_paused([*args, "--resume"], "before-manifest", signal.SIGINT, str(tmp_path / "marker2"))
    assert proc.returncode == 130, proc.stderr
    assert os.path.exists(os.path.join(dst, ".metadata"))  # after every data file, before the manifest
    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr
    names = sorted(n for n in os.listdir(dst) if n.endswith(".distcp"))
    metadata = os.stat(os.path.join(dst, ".metadata")).st_mtime_ns
    assert all(os.stat(os.path.join(dst, n)).st_mtime_ns <= metadata for n in names)
    assert_equal(read_back(dst), full_tensors(job["full"]))
    assert interrupts.PAUSE_ENV not in os.environ


def test_an_overwrite_removes_the_earlier_metadata_first(job: dict[str, str], tmp_path: Path) -> None:
    dst = str(tmp_path / "d")
    api.transform(job["full"], dst, None, None, output=api.OutputSpec(format="dcp", dcp_ranks=3))
    args = ["transform", job["full"], dst, "--output-format", "dcp", "--dcp-ranks", "2", "--overwrite"]
    proc = run_paused(args, "file", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    assert not os.path.exists(os.path.join(dst, ".metadata"))  # the earlier checkpoint no longer looks complete
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert sorted(n for n in os.listdir(dst) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert_equal(read_back(dst), full_tensors(job["full"]))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--crc"], "--crc is MindSpore's .ckpt trailer"),
        (["--prefix", "x_"], "give no --prefix"),
        (["--ranks", "0"], "give no destination ranks"),
    ],
)
def test_refusals_are_one_line(job: dict[str, str], tmp_path: Path, extra: list[str], words: str) -> None:
    proc = run_cli(
        "transform", job["r8"], str(tmp_path / "d"), "--src-strategy", job["s8"], "--output-format", "dcp", *extra
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert words in proc.stderr and not (tmp_path / "d").exists()


def test_more_refusals(job: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(b"k" * 16)
    cases = [
        ["transform", job["full"], str(tmp_path / "d"), "--output-format", "dcp", "--enc-key-file", str(key)],
        ["transform", job["full"], str(tmp_path / "d"), "--dcp-ranks", "2"],
        ["convert", job["r8"], str(tmp_path / "d"), "--to", "dcp"],
        ["transform", job["full"], str(tmp_path / "d"), "--output-format", "dcp", "--dcp-ranks", "0"],
        [
            "transform",
            job["full"],
            str(tmp_path / "d"),
            "--output-format",
            "dcp",
            "--dcp-ranks",
            "2",
            "--dst-strategy",
            job["s4"],
        ],
    ]
    for args in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and not (tmp_path / "d").exists()


def test_the_format_object_refuses_encryption_and_odd_names() -> None:
    from reshard.errors import UnsupportedError, UsageError

    with pytest.raises(UnsupportedError):
        DISTCP.write_encrypted("x.distcp", None, lambda fd, lay: None, b"k", "AES-GCM")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        parse_chunk_name("no-offsets")
    assert parse_chunk_name("a.b@1,2") == ("a.b", (1, 2)) and parse_chunk_name("step@") == ("step", ())


def test_the_framing_is_final_but_for_the_crc_fields() -> None:
    """A .distcp's framing is hashed while written, less each archive's CRC-32 fields, which are final
    only once ``seal`` wrote them (``execute.local._final_framing``)."""
    from reshard import dtypes
    from reshard.execute.local import _final_framing
    from reshard.formats.base import TensorSpec
    from reshard.formats.distcp_format import DISTCP

    specs = [TensorSpec(dcp.chunk_name(f"w{i}", (0, 0)), dtypes.FLOAT32, (2, 3), 24) for i in range(3)]
    lay = DISTCP.layout(specs, {}, 1 << 20)
    framed = {p for offset, data in lay.framing for p in range(offset, offset + len(data))}
    holes = {p for offset, size in lay.sealed() for p in range(offset, offset + size)}
    final = [p for offset, length in _final_framing(lay) for p in range(offset, offset + length)]
    assert len(holes) == 3 * 2 * 4 and holes <= framed  # two 4-byte fields per archive
    assert sorted(final) == sorted(framed - holes) and len(final) == len(set(final))
