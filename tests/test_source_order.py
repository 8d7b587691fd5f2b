"""Reading a source in its own order, in large requests: ``local.source_order`` and ``pagecache``.

A file copied from one source alone (a convert) is filled in the source's order, after the record
heads its index left cached in cold stretches are dropped; outputs read from several sources keep
their own order. Neither changes a byte of any output.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.execute import local, pagecache
from reshard.execute.options import RunOptions
from reshard.formats import uncached
from reshard.formats.ckpt import read_ckpt, save_ckpt
from reshard.formats.safetensors import read_safetensors
from tests.page_helpers import evict

PAGE = pagecache.PAGE


def _ckpt(path: Path, names: list[str], rows: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    tensors = {name: rng.standard_normal((rows, 256)).astype(np.float32) for name in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_ckpt(path, list(tensors.items()))
    return tensors


def _filled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    filled: list[str] = []
    real = local._fill_tensor
    monkeypatch.setattr(local, "_fill_tensor", lambda out, t, *rest: (filled.append(t.name), real(out, t, *rest)))
    return filled


def test_a_convert_fills_its_output_in_the_source_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["zeta.weight", "alpha.weight", "mid.bias", "beta.weight"]  # not the sorted order
    tensors = _ckpt(tmp_path / "src" / "model.ckpt", names)
    filled = _filled(monkeypatch)
    dropped: list[str] = []
    monkeypatch.setattr(pagecache, "drop_islands", lambda path, segments, reads=(): dropped.append(path) or 0)
    monkeypatch.setattr(uncached, "left_none", lambda: False)  # a small read went through the page cache
    api.convert(str(tmp_path / "src" / "model.ckpt"), str(tmp_path / "out"), "safetensors", run=RunOptions(workers=1))
    assert filled == names  # the .ckpt's record order, not the safetensors file's sorted one
    assert dropped == [str(tmp_path / "src" / "model.ckpt")]  # its islands first, once
    out = read_safetensors(tmp_path / "out" / "model.safetensors")
    try:
        assert list(out.entries) == sorted(names)
        for name, value in tensors.items():
            assert np.array_equal(out.array(name), value)
    finally:
        out.close()


def test_the_source_order_changes_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["zeta.weight", "alpha.weight", "mid.bias", "beta.weight"]
    _ckpt(tmp_path / "src" / "model.ckpt", names)
    api.convert(str(tmp_path / "src" / "model.ckpt"), str(tmp_path / "ordered"), "safetensors")
    monkeypatch.setattr(local, "source_order", lambda order, *rest: list(order))
    api.convert(str(tmp_path / "src" / "model.ckpt"), str(tmp_path / "layout"), "safetensors")
    ordered = (tmp_path / "ordered" / "model.safetensors").read_bytes()
    assert ordered == (tmp_path / "layout" / "model.safetensors").read_bytes()


class _Copy:
    def __init__(self, source: int, tensor: str) -> None:
        self.source, self.tensor = source, tensor


class _Tensor:
    def __init__(self, name: str, sources: tuple[int, ...]) -> None:
        self.copies = [_Copy(source, name) for source in sources]


class _Plan:
    quantized = ()

    def __init__(self, sources: dict[int, str]) -> None:
        self.sources = sources


def test_an_output_read_from_several_sources_keeps_its_own_order(tmp_path: Path) -> None:
    """Each output tensor reads both rank files (a merge): no source's order is taken. Read from one
    of them alone, the output follows that file's record order."""
    names = ["zeta.weight", "alpha.weight"]
    for rank in (0, 1):
        _ckpt(tmp_path / f"rank_{rank}" / "checkpoint.ckpt", names, rows=32)
    plan = _Plan({rank: str(tmp_path / f"rank_{rank}" / "checkpoint.ckpt") for rank in (0, 1)})
    order = sorted(names)
    both = {name: _Tensor(name, (0, 1)) for name in names}
    one = {name: _Tensor(name, (1,)) for name in names}
    cache = local.SourceCache(read_ckpt)
    try:
        assert local.single_source(order, both, plan) is None  # type: ignore[arg-type]
        assert local.source_order(order, both, plan, cache) == order  # type: ignore[arg-type]
        assert local.single_source(order, one, plan) == plan.sources[1]  # type: ignore[arg-type]
        assert local.source_order(order, one, plan, cache) == names  # type: ignore[arg-type]
    finally:
        cache.close()


def test_head_gaps_cover_each_head_and_the_pages_its_read_cached() -> None:
    reach = pagecache.ISLAND_REACH
    big = 64 * PAGE + reach
    runs = [(100, 10 * PAGE), (10 * PAGE + 300, big)]  # a 200-byte head between two runs
    gaps = pagecache.head_gaps(runs, 10**9)
    probe = -(-(10 * PAGE + 300 + reach) // PAGE) * PAGE
    assert gaps == [((10 * PAGE, probe - 10 * PAGE), probe)]
    assert pagecache.head_gaps(list(reversed(runs)), 10**9) == gaps  # any order


def test_head_gaps_leave_out_long_gaps_and_carry_over_short_runs() -> None:
    reach = pagecache.ISLAND_REACH
    big = 64 * PAGE + reach
    long_gap = [(0, 4 * PAGE), (4 * PAGE + pagecache.MAX_GAP_BYTES + 1, big)]
    assert pagecache.head_gaps(long_gap, 10**9) == []
    # a 3 KiB tensor between two heads: one range from the first head to past the second
    short = [(0, 8 * PAGE), (8 * PAGE + 200, 3072), (8 * PAGE + 3400, big)]
    ((offset, length), probe) = pagecache.head_gaps(short, 10**9)[0]
    assert offset == 8 * PAGE and offset + length == probe > 8 * PAGE + 3400 + reach - PAGE
    # a next run that ends before its probe page (the file's end counts too): left out
    assert pagecache.head_gaps([(0, 8 * PAGE), (8 * PAGE + 200, big)], 8 * PAGE + 300 + reach) == []


def test_islands_are_cached_gaps_in_cold_stretches_only() -> None:
    gaps = [((0, 3 * PAGE), 3 * PAGE), ((8 * PAGE, 2 * PAGE), 10 * PAGE)]
    cached_pages = {0, 1, 3, 8, 10}  # both probe pages cached: warm stretches

    def cached(offset: int, length: int) -> list[bool]:
        return [(offset // PAGE + i) in cached_pages for i in range(length // PAGE)]

    assert pagecache.islands(gaps, cached) == []
    cached_pages = {0, 1, 3, 9}  # the first one warm, the second an island in a cold stretch
    assert pagecache.islands(gaps, cached) == [(8 * PAGE, 2 * PAGE)]
    cached_pages = {0, 1, 8, 9}
    assert pagecache.islands(gaps, cached) == [(0, 3 * PAGE), (8 * PAGE, 2 * PAGE)]
    cached_pages = set()
    assert pagecache.islands(gaps, cached) == []  # nothing cached: nothing to drop


def test_drop_islands_drops_the_heads_an_index_cached_in_a_cold_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    _ckpt(path, [f"layer{i}.weight" for i in range(6)], rows=256)  # 256 KiB a tensor
    index = read_ckpt(path)
    segments = [segment for entry in index.entries.values() for segment in entry.segments]
    index.close()
    fd = os.open(path, os.O_RDONLY)
    residency = pagecache.Residency.of(fd)
    assert residency is not None  # this process owns the file: mincore tells the truth
    try:
        evict(path)
        if any(residency.pages(0, residency.size)):
            pytest.skip("this filesystem keeps its pages (tmpfs): nothing to drop")
        gaps = pagecache.head_gaps(segments, residency.size)
        assert len(gaps) == 5
        for (offset, _), _probe in gaps:
            os.pread(fd, 4096, offset + PAGE - 64)  # what an index's small read of a head leaves
        assert pagecache.islands(gaps, residency.pages)
        dropped = pagecache.drop_islands(str(path), segments)
        assert dropped > 0
        assert not any(residency.pages(0, residency.size))
        os.pread(fd, residency.size, 0)  # warm: every page cached, nothing is an island
        assert pagecache.drop_islands(str(path), segments) == 0
        assert all(residency.pages(0, residency.size))
    finally:
        residency.close()
        os.close(fd)


def test_no_residency_for_a_file_the_process_neither_owns_nor_may_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux then reports only this process's own mappings: asking would call every page cold."""
    path = tmp_path / "model.ckpt"
    _ckpt(path, ["a.weight", "b.weight"])
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pagecache.Residency.of(fd) is None
    finally:
        os.close(fd)
    index = read_ckpt(path)
    segments = [segment for entry in index.entries.values() for segment in entry.segments]
    index.close()
    assert pagecache.drop_islands(str(path), segments) == 0


def test_a_warm_file_is_told_by_a_few_probe_pages() -> None:
    gaps = [((i * 100 * PAGE, 2 * PAGE), i * 100 * PAGE + 20 * PAGE) for i in range(64)]
    asked: list[int] = []

    def warm(offset: int, length: int) -> list[bool]:
        asked.append(offset)
        return [True] * (length // PAGE)

    assert not pagecache.cold_somewhere(gaps, warm)
    assert len(asked) == pagecache.SAMPLES  # eight calls, not one a gap

    def cold_tail(offset: int, length: int) -> list[bool]:
        return [offset < 60 * 100 * PAGE] * (length // PAGE)

    assert pagecache.cold_somewhere(gaps, cold_tail)  # the last sample lies in the cold stretch
    assert not pagecache.cold_somewhere([], warm)


def test_a_reshard_drops_the_islands_of_every_source_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 rank files to 4: each output reads several sources, each source's islands are dropped once,
    before the first output that reads it; the outputs are the same bytes as without it."""
    from tests.trust_helpers import make_job, tree

    job = make_job(str(tmp_path / "job"))
    dropped: list[str] = []
    monkeypatch.setattr(pagecache, "drop_islands", lambda path, segments, reads=(): dropped.append(path) or 0)
    monkeypatch.setattr(uncached, "left_none", lambda: False)  # small reads went through the page cache
    api.transform(job["r8"], str(tmp_path / "four"), job["s8"], job["s4"], run=RunOptions(workers=3))
    sources = sorted(str(p) for p in Path(job["r8"]).glob("rank_*/*.ckpt"))
    assert sorted(dropped) == sources  # all eight, once each
    dropped.clear()
    monkeypatch.setattr(uncached, "left_none", lambda: True)  # every small read went uncached: no islands
    api.transform(job["r8"], str(tmp_path / "uncached"), job["s8"], job["s4"], run=RunOptions(workers=3))
    assert dropped == []
    monkeypatch.setattr(local.SourceCache, "drop_islands", lambda self, path: None)
    api.transform(job["r8"], str(tmp_path / "plain"), job["s8"], job["s4"], run=RunOptions(workers=3))
    ours = {k: v for k, v in tree(str(tmp_path / "four")).items() if "manifest" not in k}
    assert ours == {k: v for k, v in tree(str(tmp_path / "plain")).items() if "manifest" not in k}


def test_read_ranges_cover_each_sample_and_the_pages_after_it() -> None:
    reach = pagecache.ISLAND_REACH
    ((offset, length), probe) = pagecache.read_ranges([(10 * PAGE + 100, 4096)], 10**9)[0]
    assert offset == 10 * PAGE and offset + length == probe >= 10 * PAGE + 100 + 4096 + reach
    assert pagecache.read_ranges([(0, 4096)], 4096 + reach) == []  # the probe page past the end
    assert pagecache.read_ranges([(0, 0)], 10**9) == []


def test_the_replica_checks_samples_are_asked_for_at_once_and_dropped_when_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where small reads go through the page cache, its blocks are hinted together before they are
    read (one round of the disk, not one each), and the pages they left in a cold file are islands
    the executor drops."""
    from reshard.sources import replicas
    from tests.trust_helpers import make_job

    job = make_job(str(tmp_path / "job"))
    monkeypatch.setattr(uncached, "left_none", lambda: False)
    hinted: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hinted.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    api.transform(job["r8"], str(tmp_path / "full"), job["s8"], None)
    monkeypatch.setattr(os, "posix_fadvise", real)
    index = read_ckpt(sorted(Path(job["r8"]).glob("rank_0/*.ckpt"))[0])
    try:
        sampled = {r for e in index.entries.values() for r in replicas.sampled_ranges(e.segments, e.nbytes)}
    finally:
        index.close()
    assert sampled & set(hinted)  # rank 0's copies: hinted before they were read

    path = tmp_path / "big.ckpt"
    _ckpt(path, [f"layer{i}.weight" for i in range(4)], rows=512)  # 512 KiB a tensor
    index = read_ckpt(path)
    entries = list(index.entries.values())
    index.close()
    reads = [r for e in entries for r in replicas.sampled_ranges(e.segments, e.nbytes)]
    fd = os.open(path, os.O_RDONLY)
    residency = pagecache.Residency.of(fd)
    assert residency is not None
    try:
        evict(path)
        if any(residency.pages(0, residency.size)):
            pytest.skip("this filesystem keeps its pages (tmpfs): nothing to drop")
        for offset, length in reads:
            os.pread(fd, length, offset)  # what the check leaves
        middle = entries[1].segments[0][0] + entries[1].nbytes // 2
        assert residency.pages(middle - middle % PAGE, PAGE) == [True]
        assert pagecache.drop_islands(str(path), [s for e in entries for s in e.segments], reads) > 0
        assert residency.pages(middle - middle % PAGE, PAGE) == [False]
    finally:
        residency.close()
        os.close(fd)
