"""Reading the sources ahead while a run starts (``reshard.readahead``): which files, in which order,
how many bytes, from which faces, and that nothing of the user's changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard import readahead
from reshard.cli import _read_ahead
from reshard.cli.parser import build_parser
from tests.test_cli import snapshot
from tests.trust_helpers import SMALL, make_job


def _write(path: Path, size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return str(path)


def test_checkpoint_files_are_the_checkpoints_in_natural_rank_order(tmp_path: Path) -> None:
    for r in (10, 2, 0, 1):
        _write(tmp_path / f"rank_{r}" / f"checkpoint_{r}.ckpt", 1)
    _write(tmp_path / "rank_0" / "notes.json", 1)
    _write(tmp_path / "part_1.safetensors", 1)
    _write(tmp_path / "a" / "b" / "c" / "d" / "too_deep.ckpt", 1)
    names = [os.path.relpath(p, tmp_path) for p in readahead.checkpoint_files(str(tmp_path))]
    assert names == [
        "part_1.safetensors",
        "rank_0/checkpoint_0.ckpt",
        "rank_1/checkpoint_1.ckpt",
        "rank_2/checkpoint_2.ckpt",
        "rank_10/checkpoint_10.ckpt",
    ]
    one = _write(tmp_path / "model.safetensors", 1)
    assert readahead.checkpoint_files(one) == [one]
    assert readahead.checkpoint_files(str(tmp_path / "missing")) == []


def test_hints_stop_at_the_budget_in_file_order_and_chunks(tmp_path: Path) -> None:
    mib = 1024**2
    for r in range(3):
        _write(tmp_path / f"rank_{r}" / "x.ckpt", 40 * mib)
    calls: list[tuple[str, int, int]] = []

    def advise(fd: int, offset: int, length: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    hinted = readahead.hint([str(tmp_path)], 70 * mib, advise)
    assert hinted == 70 * mib
    assert sum(length for _, _, length in calls) == 70 * mib
    assert [os.path.basename(os.path.dirname(name)) for name, _, _ in calls] == ["rank_0"] * 3 + ["rank_1"] * 2
    assert all(length <= readahead.HINT_BYTES for _, _, length in calls)
    assert calls[3][1] == 0  # the second file from its start


def test_two_sources_share_the_budget(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.safetensors", 10 * 1024**2)
    b = _write(tmp_path / "b.safetensors", 10 * 1024**2)
    seen: dict[str, int] = {}

    def advise(fd: int, offset: int, length: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        seen[name] = seen.get(name, 0) + length

    readahead.hint([a, b], 8 * 1024**2, advise)
    assert seen == {a: 4 * 1024**2, b: 4 * 1024**2}


def test_nothing_to_read_starts_no_thread(tmp_path: Path) -> None:
    assert readahead.start([]) is None
    assert readahead.start([None]) is None
    assert readahead.start([str(tmp_path)], budget=0) is None
    thread = readahead.start([str(tmp_path / "missing")])  # a wrong path: the thread ends quietly
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()


def test_reading_ahead_changes_nothing(tmp_path: Path) -> None:
    job = make_job(str(tmp_path / "job"), SMALL)
    before = snapshot(job["r8"])
    os.chmod(f"{job['r8']}/rank_3", 0o500)  # a read-only folder is read all the same
    thread = readahead.start([job["r8"]])
    assert thread is not None
    thread.join(30)
    os.chmod(f"{job['r8']}/rank_3", 0o755)
    assert snapshot(job["r8"]) == before


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt"], ["SRC"]),
        (["transform", "--src", "SRC", "--dst", "DST", "--dst-strategy", "s.ckpt"], ["SRC"]),
        (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--ranks", "0-1"], []),
        (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--executor", "ray"], []),
        (["unify", "SRC", "DST", "--src-strategy", "s.ckpt"], ["SRC"]),
        (["convert", "SRC", "DST", "--to", "safetensors"], ["SRC"]),
        (["split", "SRC", "DST", "--dst-strategy", "s.ckpt"], ["SRC"]),
        (["verify", "A", "B"], ["A", "B"]),
        (["inspect", "SRC"], []),  # headers only
        (["plan", "SRC", "DST", "--dst-strategy", "s.ckpt"], []),  # no data read
    ],
)
def test_the_command_reads_ahead_what_it_reads_whole(argv: list[str], expected: list[str]) -> None:
    assert _read_ahead(build_parser().parse_args(argv)) == expected


def test_the_dropin_reads_ahead_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard import mindspore as ms
    from reshard.mindspore import dropin

    job = make_job(str(tmp_path / "job"), SMALL)
    started: list[list[str]] = []
    monkeypatch.setattr(dropin.readahead, "start", lambda paths: started.append(list(paths)))
    ms.transform_checkpoints(job["r8"], str(tmp_path / "r4"), "checkpoint_", job["s8"], job["s4"])
    ms.ckpt_to_safetensors(job["r8"], str(tmp_path / "st"))
    assert started == [[job["r8"]], [job["r8"]]]
