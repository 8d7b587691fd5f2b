"""Kernel-side copies (``reshard.execute.kernelcopy``): splice through a pipe at unequal page offsets,
``copy_file_range`` at equal ones, and what happens when either is refused or fails midway."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from reshard.execute import kernelcopy
from reshard.execute.kernelcopy import Copier

PAGE = os.sysconf("SC_PAGE_SIZE")


def _files(tmp_path: Path, size: int) -> tuple[bytes, int, int, Path]:
    data = os.urandom(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    dst = tmp_path / "dst.bin"
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.ftruncate(dst_fd, size + PAGE)
    return data, src_fd, dst_fd, dst


def _calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[object, ...]]:
    seen: list[tuple[object, ...]] = []
    real = getattr(os, name)

    def spy(*args: object, **kwargs: object) -> int:
        seen.append(args)
        return int(real(*args, **kwargs))

    monkeypatch.setattr(os, name, spy)
    return seen


@pytest.mark.parametrize(("src_off", "dst_off"), [(100, 0), (0, 4097), (3, PAGE + 5), (PAGE, 2 * PAGE + 1)])
def test_unequal_page_offsets_splice_through_the_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_off: int, dst_off: int
) -> None:
    size = 3 * kernelcopy.PIPE_BYTES + 12345  # several pipe rounds and a short last one
    data, src_fd, dst_fd, dst = _files(tmp_path, size)
    splices, ranges = _calls(monkeypatch, "splice"), _calls(monkeypatch, "copy_file_range")
    copier = Copier()
    try:
        n = size - src_off
        copier.copy(src_fd, dst_fd, src_off, dst_off, n)
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes()[dst_off : dst_off + n] == data[src_off:]
    assert splices and not ranges


def test_equal_page_offsets_keep_copy_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem may share blocks or copy on its server for these: ``copy_file_range`` lets it."""
    data, src_fd, dst_fd, dst = _files(tmp_path, 5 * PAGE + 7)
    splices, ranges = _calls(monkeypatch, "splice"), _calls(monkeypatch, "copy_file_range")
    copier = Copier()
    try:
        copier.copy(src_fd, dst_fd, 10, PAGE + 10, len(data) - 10)
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes()[PAGE + 10 : PAGE + len(data)] == data[10:]
    assert ranges and not splices


def test_each_thread_has_its_own_pipe_and_close_closes_them(tmp_path: Path) -> None:
    import threading

    copier = Copier()
    made: list[tuple[int, int]] = []
    together = threading.Barrier(3)  # alive at once: a finished thread's identity may be reused

    def take() -> None:
        made.append(copier.pipe())
        together.wait()

    threads = [threading.Thread(target=take) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 3
    assert copier.pipe() == copier.pipe()  # reused within a thread
    copier.close()
    for read_end, write_end in made:
        for fd in (read_end, write_end):
            with pytest.raises(OSError):
                os.fstat(fd)


def test_a_failed_splice_drops_the_pipe_that_may_hold_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, src_fd, dst_fd, dst = _files(tmp_path, 2 * kernelcopy.PIPE_BYTES)
    real = os.splice
    state = {"calls": 0}

    def failing(*args: object, **kwargs: object) -> int:
        state["calls"] += 1
        if state["calls"] == 3:  # the second round's read: the pipe may still hold bytes
            raise OSError(errno.EIO, "disk error")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    copier = Copier()
    try:
        first = copier.pipe()
        monkeypatch.setattr(os, "splice", failing)
        with pytest.raises(OSError) as raised:
            copier.copy(src_fd, dst_fd, 1, 0, len(data) - 1)
        assert raised.value.errno == errno.EIO
        with pytest.raises(OSError):
            os.fstat(first[0])  # closed, not kept with stray bytes in it
        monkeypatch.setattr(os, "splice", real)
        copier.copy(src_fd, dst_fd, 1, 0, len(data) - 1)  # through a fresh pipe
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes()[: len(data) - 1] == data[1:]


def test_a_refused_splice_switches_to_copy_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, src_fd, dst_fd, dst = _files(tmp_path, 3 * PAGE)

    def refused(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EINVAL, "splice not supported")

    monkeypatch.setattr(os, "splice", refused)
    copier = Copier()
    try:
        copier.copy(src_fd, dst_fd, 5, 0, len(data) - 5)
        assert not copier.splicing
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes()[: len(data) - 5] == data[5:]


def test_a_source_that_ends_early_is_an_error(tmp_path: Path) -> None:
    data, src_fd, dst_fd, _ = _files(tmp_path, 2 * PAGE)
    copier = Copier()
    try:
        for dst_off in (1, 0):  # splice, then copy_file_range
            with pytest.raises(OSError) as raised:
                copier.copy(src_fd, dst_fd, 0, dst_off, len(data) + 10)
            assert raised.value.errno == errno.EIO
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)


def test_a_pipe_that_cannot_grow_still_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    def refused(fd: int, cmd: int, arg: int = 0) -> int:
        raise PermissionError(errno.EPERM, "over pipe-max-size")

    monkeypatch.setattr(fcntl, "fcntl", refused)
    data, src_fd, dst_fd, dst = _files(tmp_path, 300_000)  # several rounds of a 64 KiB pipe
    copier = Copier()
    try:
        copier.copy(src_fd, dst_fd, 7, 0, len(data) - 7)
    finally:
        copier.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes()[: len(data) - 7] == data[7:]


def test_a_run_whose_filesystem_refuses_both_copies_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor falls back from splice to ``copy_file_range`` to ``pwrite``: the same file each way."""
    import numpy as np

    from reshard import api
    from reshard.formats.safetensors import save_safetensors

    src = tmp_path / "model.safetensors"
    tensors = {"a": np.arange(70_000, dtype=np.float32).reshape(7, 10_000), "b": np.arange(33, dtype=np.int16)}
    save_safetensors(str(src), tensors)
    fast, slow = tmp_path / "fast", tmp_path / "slow"  # folders: the .ckpt and its manifest
    api.convert(str(src), str(fast), "ckpt")  # tensors move to .ckpt records: unequal page offsets

    def refused(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EXDEV, "refused")

    monkeypatch.setattr(os, "splice", refused)
    monkeypatch.setattr(os, "copy_file_range", refused)
    api.convert(str(src), str(slow), "ckpt")
    (made,) = fast.glob("*.ckpt")
    assert made.read_bytes() == (slow / made.name).read_bytes()
