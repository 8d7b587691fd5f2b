"""Small reads that leave nothing in the page cache (``formats.uncached``), and the index and replica
check that make them: the bytes are a plain ``pread``'s, a kernel or file system that refuses
``RWF_DONTCACHE`` gets a plain read (and the executor then looks for islands), and on a kernel that
takes it an index leaves no page cached between the tensors the copy reads next."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard.execute import pagecache
from reshard.formats import ckpt, uncached
from tests.page_helpers import evict

PAGE = pagecache.PAGE


@pytest.fixture(autouse=True)
def fresh_tally(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an untried kernel, and its fakes do not outlive it."""
    monkeypatch.setattr(uncached, "_TALLY", uncached._Tally())


def _file(tmp_path: Path, size: int = 64 * 1024) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _refusing(error: BaseException) -> tuple[Callable[..., Any], list[int]]:
    calls: list[int] = []

    def preadv(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        calls.append(flags)
        raise error

    return preadv, calls


def test_read_returns_what_pread_returns(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in [(0, 4096), (4095, 100), (len(data) - 10, 4096), (len(data), 4096), (len(data) + 9, 8)]:
            assert bytes(uncached.read(fd, length, offset)) == data[offset : offset + length]
    finally:
        os.close(fd)


def _two_reads_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[int]:
    """Two reads where ``preadv2`` fails with ``error``: they return a plain read's bytes, and the
    executor is told to look for islands; the flags ``preadv2`` was called with."""
    path, data = _file(tmp_path)
    preadv, calls = _refusing(error)
    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert uncached.read(fd, 100, 7) == data[7:107]
        assert uncached.read(fd, 100, 2000) == data[2000:2100]
    finally:
        os.close(fd)
    assert not uncached.left_none()
    return calls


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EINVAL, "a kernel before 6.14"),
        OSError(errno.ENOSYS, "a kernel without preadv2"),
        NotImplementedError("preadv2: flags unavailable on this platform"),
    ],
    ids=["EINVAL", "ENOSYS", "no-preadv2"],
)
def test_a_kernel_or_platform_without_the_flag_is_asked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    assert _two_reads_refused(tmp_path, monkeypatch, error) == [uncached.RWF_DONTCACHE]  # then plain reads
    assert not uncached._TALLY.kernel_takes


def test_a_file_system_without_it_gets_plain_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another file system of the same run may take it: the flag is asked for again next time."""
    calls = _two_reads_refused(tmp_path, monkeypatch, OSError(errno.EOPNOTSUPP, "not supported"))
    assert len(calls) == 2 and uncached._TALLY.kernel_takes


def test_a_read_error_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _file(tmp_path)
    preadv, _ = _refusing(OSError(errno.EIO, "I/O error"))
    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as caught:
            uncached.read(fd, 10, 0)
    finally:
        os.close(fd)
    assert caught.value.errno == errno.EIO


def _residency(path: Path) -> tuple[int, pagecache.Residency]:
    fd = os.open(path, os.O_RDONLY)
    residency = pagecache.Residency.of(fd)
    assert residency is not None  # this process owns the file: mincore tells the truth
    return fd, residency


def test_on_this_machine_a_cold_read_caches_nothing_and_a_cached_page_stays(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 1024 * 1024)
    evict(path)
    fd, residency = _residency(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the index and the check read: no read-ahead
        assert uncached.read(fd, 4096, 100 * PAGE) == data[100 * PAGE : 101 * PAGE]
        if uncached.left_none():  # Linux 6.14 or later, on a file system that takes the flag
            assert not any(residency.pages(0, residency.size))
        else:
            assert any(residency.pages(100 * PAGE, PAGE))  # a plain read: the executor drops it later
        os.pread(fd, 4096, 200 * PAGE)
        assert uncached.read(fd, 4096, 200 * PAGE) == data[200 * PAGE : 201 * PAGE]
        assert residency.pages(200 * PAGE, PAGE) == [True]  # cached before: cached after
    finally:
        residency.close()
        os.close(fd)


def test_an_index_of_a_cold_file_leaves_no_record_head_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel takes the flag; elsewhere its heads are the islands ``execute.pagecache`` drops."""
    rng = np.random.default_rng(3)
    tensors = [(f"layer{i}.weight", rng.standard_normal((256, 256)).astype(np.float32)) for i in range(6)]
    tensors += [(f"layer{i}.norm", rng.standard_normal(8).astype(np.float32)) for i in range(20)]
    path = tmp_path / "model.ckpt"
    ckpt.save_ckpt(path, tensors)
    monkeypatch.setattr(ckpt._MEMO, "recall", lambda identity: None)  # index afresh
    evict(path)
    index = ckpt.read_ckpt(path)
    try:
        assert list(index.entries) == [name for name, _ in tensors]
        fd, residency = _residency(path)
        try:
            cached = [k for k, flag in enumerate(residency.pages(0, residency.size)) if flag]
        finally:
            residency.close()
            os.close(fd)
    finally:
        index.close()
    if uncached.left_none():
        assert all(k < 4 for k in cached), str(
            cached
        )  # the first bytes only (the encryption magic), no head further on
    else:
        assert cached
