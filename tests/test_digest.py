"""The checksum the executor computes while writing equals a fresh hash of the finished file."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import threading

import blake3
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import api, manifest
from reshard.execute import digest as digest_mod
from reshard.execute.digest import StreamingDigest, file_digest, hash_pool
from reshard.execute.options import RunOptions, WriteOptions
from reshard.manifest import read_manifest
from tests.trust_helpers import make_job, run_cli


def _pieces(size: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, size, *(c % (size + 1) for c in cuts)})
    return [(a, b - a) for a, b in itertools.pairwise(points)]


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 3 * 1024 * 1024),
    cuts=st.lists(st.integers(0, 1 << 30), max_size=12),
    seed=st.integers(0, 1 << 16),
    skip=st.booleans(),
)
@pytest.mark.parametrize("algorithm", ["xxh128", "blake3", "sha256"])
def test_streaming_hash_matches_a_fresh_hash_in_any_order(
    tmp_path_factory, algorithm: str, size: int, cuts: list[int], seed: int, skip: bool
) -> None:
    path = tmp_path_factory.mktemp("d") / "f.bin"
    data = random.Random(seed).randbytes(size)
    pieces = _pieces(size, cuts)
    random.Random(seed).shuffle(pieces)
    if skip and pieces:  # a range never reported (zeros the layout leaves): result() covers it
        dropped = pieces.pop()
        data = data[: dropped[0]] + bytes(dropped[1]) + data[dropped[0] + dropped[1] :]
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, size)
        with hash_pool() as pool:
            hasher = StreamingDigest(fd, pool, algorithm)
            for offset, length in pieces:
                os.pwrite(fd, data[offset : offset + length], offset)
                hasher.finished(offset, length)
            assert hasher.result(size) == _reference(algorithm, data)
    finally:
        os.close(fd)


def _reference(algorithm: str, data: bytes) -> str:
    if algorithm == "xxh128":
        return xxhash.xxh3_128(data).hexdigest()
    return blake3.blake3(data).hexdigest() if algorithm == "blake3" else hashlib.sha256(data).hexdigest()


def test_the_default_checksum_is_the_canonical_xxh128(tmp_path) -> None:
    """XXH128 by default, as ``xxhsum -H2`` prints it: xxHash's published value of the empty input
    (big-endian, high half first) and of a file read in several blocks."""
    assert digest_mod.DEFAULT_ALGORITHM == "xxh128"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_digest(str(empty)) == (0, "99aa06d3014798d86001c324468d497f")
    data = bytes(range(256)) * (3 * digest_mod.HASH_READ_BYTES // 256 + 7)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert file_digest(str(path)) == (len(data), xxhash.xxh3_128(data).hexdigest())


@pytest.mark.parametrize("algorithm", ["xxh128", "blake3", "sha256"])
def test_streaming_hash_from_many_threads(tmp_path, monkeypatch, algorithm: str) -> None:
    monkeypatch.setattr(digest_mod, "HASH_READ_BYTES", 4096)
    monkeypatch.setattr(digest_mod, "_THREAD", threading.local())
    size = 1 << 20
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, size)
        with hash_pool() as pool:
            hasher = StreamingDigest(fd, pool, algorithm)

            def write(part: int) -> None:
                for offset in range(part * 4096, size, 4 * 4096):
                    os.pwrite(fd, data[offset : offset + 4096], offset)
                    hasher.finished(offset, 4096)

            threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert hasher.result(size) == _reference(algorithm, data)
    finally:
        os.close(fd)


def test_read_error_is_raised_by_result(tmp_path) -> None:
    fd = os.open(tmp_path / "short.bin", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"abc")
        with hash_pool() as pool:
            hasher = StreamingDigest(fd, pool)
            with pytest.raises(OSError, match="ended at byte 3"):
                hasher.result(10)  # the file is shorter than what the caller says was written
    finally:
        os.close(fd)


def test_abandon_lets_go_of_the_descriptor(tmp_path) -> None:
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, bytes(1 << 20))
        with hash_pool() as pool:
            hasher = StreamingDigest(fd, pool)
            hasher.finished(0, 1 << 19)
            hasher.abandon()
            hasher.finished(1 << 19, 1 << 19)  # ignored after abandon: nothing reads the fd any more
    finally:
        os.close(fd)


@pytest.mark.parametrize("target", ["r8", "r8st"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize(("crc", "algorithm"), [(False, "xxh128"), (False, "blake3"), (True, "sha256")])
def test_manifest_digests_equal_a_fresh_read(tmp_path, target: str, workers: int, crc: bool, algorithm: str) -> None:
    """Every output's manifest checksum (computed while writing) is the hash of the file on disk."""
    job = make_job(str(tmp_path / "job"))
    for dst_strategy, out in ((job["s4"], tmp_path / "to4"), (None, tmp_path / "full")):
        api.transform(
            job[target],
            str(out),
            job["s8"],
            dst_strategy,
            write=WriteOptions(write_crc=crc and target == "r8", checksum=algorithm),
            run=RunOptions(workers=workers),
        )
        doc = read_manifest(str(out))
        assert doc["outputs"] and doc["checksum"] == algorithm
        for item in doc["outputs"]:
            expected = file_digest(os.path.join(out, item["path"]), algorithm)
            assert (item["bytes"], item[algorithm]) == expected, item["path"]


def test_plain_outputs_are_not_read_back(tmp_path, monkeypatch) -> None:
    """The executor hashed every plain output while writing it: the recorder never re-reads one."""
    job = make_job(str(tmp_path / "job"))
    read_back: list[str] = []
    real = manifest.file_digest
    monkeypatch.setattr(
        manifest, "file_digest", lambda path, algorithm: read_back.append(path) or real(path, algorithm)
    )
    api.transform(job["r8"], str(tmp_path / "out"), job["s8"], job["s4"], run=RunOptions(workers=2))
    assert read_back == []


def test_cli_checksum_choice(tmp_path) -> None:
    """``--checksum sha256`` gives ``sha256sum``-compatible records; an unknown name is one clean line."""
    job = make_job(str(tmp_path / "job"))
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", job["r8"], "--dst", str(out), "--src-strategy", job["s8"], "--checksum", "sha256"
    )
    assert proc.returncode == 0, proc.stderr
    doc = read_manifest(str(out))
    assert doc["checksum"] == "sha256"
    for item in doc["outputs"]:
        with open(out / item["path"], "rb") as fh:
            assert item["sha256"] == hashlib.sha256(fh.read()).hexdigest()
    bad = run_cli(
        "transform",
        "--src",
        job["r8"],
        "--dst",
        str(tmp_path / "bad"),
        "--src-strategy",
        job["s8"],
        "--checksum",
        "md5",
    )
    assert bad.returncode == 2 and "md5" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
