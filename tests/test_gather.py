"""Strided boxes gathered from the sources' maps by ``pwritev`` (``execute.gather``).

``bands`` and ``write_bands`` are checked together against a naive reference (materialise every
source with numpy, copy each box into a zeroed output) on random tilings of dims 0 and 1, sources
larger than their boxes, item sizes 1, 2 and 4, and calls cut small; the cases the path leaves to
the staging copy, and a short write, on their own. A merge, a reshard, a unify and a split of a
model with column splits write the same bytes through this path as through the staging one, and
a column merge imports no numpy.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import api, dtypes
from reshard.execute import gather
from reshard.plan import Copy, TensorPlan
from reshard.synthetic import ModelShape
from tests.trust_helpers import make_job, tree

ITEM_DTYPES = {1: dtypes.UINT8, 2: dtypes.FLOAT16, 4: dtypes.FLOAT32}


def _cuts(draw: st.DrawFn, n: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3, unique=True)) if n > 1 else []
    return [0, *sorted(inner), n]


@st.composite
def tilings(draw: st.DrawFn) -> tuple[TensorPlan, list[tuple[int, ...]], int]:
    """A tensor tiled by boxes on dims 0 and 1 (each band of rows cut into columns its own way), each
    box taken from a source tensor that may be larger than it on dims 0 and 1."""
    item = draw(st.sampled_from([1, 2, 4]))
    shape = (draw(st.integers(1, 9)), draw(st.integers(1, 9)), *draw(st.lists(st.integers(1, 3), max_size=2)))
    rows = _cuts(draw, shape[0])
    copies: list[Copy] = []
    src_shapes: list[tuple[int, ...]] = []
    for r0, r1 in itertools.pairwise(rows):
        cols = _cuts(draw, shape[1])
        for c0, c1 in itertools.pairwise(cols):
            pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
            start = (draw(st.integers(0, pad[0])), draw(st.integers(0, pad[1])))
            src_shape = (r1 - r0 + pad[0], c1 - c0 + pad[1], *shape[2:])
            rest = (0,) * len(shape[2:])
            copies.append(Copy(len(copies), "t", (*start, *rest), (r0, c0, *rest), (r1 - r0, c1 - c0, *shape[2:])))
            src_shapes.append(src_shape)
    order = draw(st.permutations(range(len(copies))))  # the plan lists boxes in any order
    t = TensorPlan("t", ITEM_DTYPES[item], shape, tuple(copies[k] for k in order), int(np.prod(shape)) * item)
    return t, [src_shapes[k] for k in order], item


def _reference(t: TensorPlan, sources: list[bytes], src_shapes: list[tuple[int, ...]], item: int) -> bytes:
    out = np.zeros((*t.shape, item), np.uint8)
    for c, data, shape in zip(t.copies, sources, src_shapes, strict=True):
        src = np.frombuffer(data, np.uint8).reshape(*shape, item)
        box = tuple(slice(s, s + n) for s, n in zip(c.src_start, c.lengths, strict=True))
        out[tuple(slice(s, s + n) for s, n in zip(c.dst_start, c.lengths, strict=True))] = src[box]
    return out.tobytes()


def _gathered(t: TensorPlan, sources: list[bytes], src_shapes: list[tuple[int, ...]], path: Path) -> bytes:
    bands = gather.bands(t, src_shapes, 0)
    assert bands is not None
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, b"\xee" * 7, 0)  # the tensor starts 7 bytes into the file
        with gather.addresses_of(sources) as starts:
            gather.write_bands(fd, 7, t.nbytes // t.shape[0], bands, starts, lambda: None)
        return os.pread(fd, t.nbytes, 7)
    finally:
        os.close(fd)


@settings(max_examples=200, deadline=None)
@given(tilings(), st.integers(1, 4), st.integers(0, 3), st.randoms(use_true_random=False))
def test_gathered_rows_are_the_boxes_copied_one_by_one(
    tmp_path_factory: pytest.TempPathFactory,
    tiling: tuple[TensorPlan, list[tuple[int, ...]], int],
    iov_max: int,
    block: int,
    rnd: object,
) -> None:
    t, src_shapes, item = tiling
    sources = [bytes(rnd.getrandbits(8) for _ in range(int(np.prod(s)) * item)) for s in src_shapes]  # type: ignore[attr-defined]
    mp = pytest.MonkeyPatch()
    mp.setattr(gather, "IOV_MAX", max(iov_max, max(len(set(c.dst_start[1] for c in t.copies)), 1)))  # calls cut small
    mp.setattr(gather, "BLOCK_BYTES", block)
    try:
        path = tmp_path_factory.mktemp("g") / "out"
        assert _gathered(t, sources, src_shapes, path) == _reference(t, sources, src_shapes, item)
    finally:
        mp.undo()


def _column_merge(runs_of: int = 512) -> tuple[TensorPlan, dict[int, tuple[int, ...]]]:
    """A 4 x 2*runs_of float32 tensor from two column halves (runs of 4 * runs_of bytes)."""
    f32 = dtypes.FLOAT32
    halves = (Copy(0, "w", (0, 0), (0, 0), (4, runs_of)), Copy(1, "w", (0, 0), (0, runs_of), (4, runs_of)))
    return TensorPlan("w", f32, (4, 2 * runs_of), halves, 4 * 2 * runs_of * 4), {0: (4, runs_of), 1: (4, runs_of)}


def test_the_staging_copy_keeps_what_this_path_cannot_do() -> None:
    t, shapes = _column_merge()
    assert gather.bands(t, [shapes[c.source] for c in t.copies]) is not None
    mid, mid_shapes = _column_merge(runs_of=256)  # 1 KiB runs: gathered only while numpy is not loaded
    assert gather.bands(mid, [mid_shapes[c.source] for c in mid.copies]) is None
    assert gather.bands(mid, [mid_shapes[c.source] for c in mid.copies], gather.MIN_RUN_BYTES) is not None
    short, short_shapes = _column_merge(runs_of=8)  # 32-byte runs: a vector entry each costs more than numpy
    assert gather.bands(short, [short_shapes[c.source] for c in short.copies], gather.MIN_RUN_BYTES) is None
    transposed = TensorPlan(
        "w", t.dtype, t.shape, (t.copies[0], Copy(1, "w", (0, 0), (0, 512), (4, 512), src_perm=(1, 0))), t.nbytes
    )
    assert gather.bands(transposed, [(4, 512), (512, 4)]) is None
    reshaped = gather.bands(t, [(4, 512, 1), (4, 512, 1)])  # a source of other rank (src_view): staged
    assert reshaped is None
    gap = TensorPlan("w", t.dtype, t.shape, t.copies[:1], t.nbytes)  # the right half missing
    assert gather.bands(gap, [shapes[c.source] for c in gap.copies]) is None
    f32 = dtypes.FLOAT32
    third_dim = TensorPlan(  # split on dim 2: runs of 1024 items, not the whole rows of dims 2 on
        "w",
        f32,
        (2, 2, 2048),
        (Copy(0, "w", (0, 0, 0), (0, 0, 0), (2, 2, 1024)), Copy(1, "w", (0, 0, 0), (0, 0, 1024), (2, 2, 1024))),
        2 * 2 * 2048 * 4,
    )
    assert gather.bands(third_dim, [(2, 2, 1024), (2, 2, 1024)]) is None
    assert gather.bands(TensorPlan("v", f32, (4096,), (Copy(0, "v", (0,), (0,), (4096,)),), 16384), [(4096,)]) is None


def test_short_runs_are_gathered_until_numpy_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gather.min_run_bytes() == gather.LONG_RUN_BYTES  # this test process has numpy
    monkeypatch.delitem(sys.modules, "numpy")
    assert gather.min_run_bytes() == gather.MIN_RUN_BYTES


def test_a_short_write_goes_on_from_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t, shapes = _column_merge()
    sources = [os.urandom(4 * 512 * 4), os.urandom(4 * 512 * 4)]
    calls: list[int] = []

    def five_bytes_at_most(fd: int, address: int, count: int, offset: int) -> int:
        entries = (ctypes.c_uint64 * (2 * count)).from_address(address)
        first = ctypes.string_at(entries[0], min(5, entries[1]))
        calls.append(len(first))
        return os.pwrite(fd, first, offset)

    monkeypatch.setattr(gather, "_PWRITEV", five_bytes_at_most)
    out = _gathered(t, sources, [shapes[0], shapes[1]], tmp_path / "out")
    assert out == _reference(t, sources, [shapes[0], shapes[1]], 4)
    assert len(calls) > 100 and max(calls) == 5


def test_an_error_of_the_write_is_raised_with_its_errno(tmp_path: Path) -> None:
    vector = array.array("Q", [0, 0])
    read_only = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        data = b"x" * 300
        with gather.addresses_of([data]) as (address,):
            vector[0], vector[1] = address, len(data)
            with pytest.raises(OSError) as raised:
                gather._pwritev_all(read_only, vector, 0)
        assert raised.value.errno == 9  # EBADF: not open for writing
    finally:
        os.close(read_only)


def test_a_map_is_exported_only_while_its_tensor_is_written(tmp_path: Path) -> None:
    path = tmp_path / "src"
    path.write_bytes(os.urandom(8192))
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    with gather.addresses_of([mapped, b"plain bytes"]) as starts:
        assert all(starts)
        assert ctypes.string_at(starts[0], 8192) == path.read_bytes()
        with pytest.raises(BufferError):
            mapped.close()  # exported: nothing closes it under the kernel's reads
    mapped.close()  # released again


WIDE = ModelShape(vocab=64, hidden=128, ffn=256, layers=2)  # float32 column halves: 256-byte runs


@pytest.fixture(scope="module")
def wide_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("wide")), WIDE)


@pytest.mark.parametrize("operation", ["merge", "reshard", "unify", "split"])
def test_column_splits_gathered_write_the_bytes_the_staging_copy_writes(
    wide_job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    job = wide_job
    monkeypatch.setattr(gather, "LONG_RUN_BYTES", 256)  # WIDE's runs (numpy is loaded here)
    no_manifest = api.Destination(manifest=False)

    def run(out: str) -> None:
        if operation == "merge":
            api.transform(job["r8"], out, job["s8"], None, destination=no_manifest)
        elif operation == "reshard":
            api.transform(job["r8st"], out, job["s8"], job["s4"], destination=no_manifest)
        elif operation == "unify":
            api.unify(job["r8st"], job["s8"], out, destination=no_manifest)
        else:
            api.unify(job["r8st"], job["s8"], str(tmp_path / "unified"), destination=no_manifest)
            api.split(str(tmp_path / "unified"), job["s8"], out, destination=no_manifest)

    gathered: list[int] = []
    real_write = gather.write_bands

    def counted(fd: int, *args: Any) -> None:
        gathered.append(fd)
        real_write(fd, *args)

    monkeypatch.setattr(gather, "write_bands", counted)
    run(str(tmp_path / "gathered"))
    assert gathered  # the path was taken
    monkeypatch.setattr(gather, "available", lambda: False)
    if operation == "split":
        (tmp_path / "unified").rename(tmp_path / "unified-gathered")
    run(str(tmp_path / "staged"))
    assert tree(str(tmp_path / "gathered")) == tree(str(tmp_path / "staged"))


def test_a_column_merge_imports_no_numpy(wide_job: dict[str, str], tmp_path: Path) -> None:
    script = (
        "import sys\nfrom reshard import api\nfrom reshard.execute import gather\n"
        "gather.MIN_RUN_BYTES = 256\n"  # WIDE's runs: the bench's model has 1536-byte ones
        f"api.transform({wide_job['r8']!r}, {str(tmp_path / 'out')!r}, {wide_job['s8']!r}, None)\n"
        "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('numpy.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
