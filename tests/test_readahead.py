"""Reading the sources ahead while a run starts (``reshard.readahead``): which files, in which order,
how many bytes, from which faces, and that nothing of the user's changes."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard import readahead
from reshard.cli import _read_ahead, early
from reshard.cli.parser import build_parser
from tests.page_helpers import evict
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


def _split_key(path: str) -> list[object]:
    """The naive natural key: ``re.split`` at runs of ASCII digits, numbers as numbers, trailing "" dropped."""
    import re

    key: list[object] = [int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", path)]
    return key[:-1] if len(key) > 1 and key[-1] == "" else key


@given(st.lists(st.text(alphabet="ab_/.0129", max_size=12), max_size=8), st.text(alphabet="a٣7_", max_size=6))
def test_natural_order_is_the_naive_split(paths: list[str], other_digits: str) -> None:
    """Numbers compare by value, as the naive split gives them, and any names sort: a key starts with
    text and alternates text and numbers, so it never compares a number with text (decimal digits of
    other scripts, which ``int`` reads, included)."""
    assert [readahead._natural(p) for p in paths] == [_split_key(p) for p in paths]
    for key in map(readahead._natural, [*paths, other_digits]):
        assert all(isinstance(k, str) for k in key[::2]) and all(isinstance(k, int) for k in key[1::2])
    sorted([*paths, other_digits], key=readahead._natural)


def test_reads_stop_at_the_budget_in_file_order_and_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mib = 1024**2
    monkeypatch.setattr(readahead, "READ_BYTES", 16 * mib)
    for r in range(3):
        _write(tmp_path / f"rank_{r}" / "x.ckpt", 40 * mib)
    calls: list[tuple[str, int, int]] = []

    def advise(fd: int, offset: int, length: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    hinted = readahead.hint([str(tmp_path)], 70 * mib, advise, advise)
    head = readahead.HEAD_BYTES
    assert hinted == 70 * mib
    assert sum(length for _, _, length in calls) == 70 * mib
    rank = [os.path.basename(os.path.dirname(name)) for name, _, _ in calls]
    # every file's start first (the headers planning reads), then the files whole in turn
    assert [(r, offset, length) for r, (_, offset, length) in zip(rank, calls, strict=True)][:3] == [
        (f"rank_{r}", 0, head) for r in range(3)
    ]
    assert rank[3:] == ["rank_0"] * 3 + ["rank_1"] * 2
    assert calls[3][1] == head and calls[6][1] == head  # each file's bulk from where its start ended
    assert all(length <= 16 * mib for _, _, length in calls)
    spans = sorted((name, offset, offset + length) for name, offset, length in calls)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(spans))  # no byte hinted twice


def _fake_queue(
    root: Path, device: str, window_kib: int | None, request_kib: int | None, partition: bool = False
) -> None:
    """A ``/sys/dev/block/<major>:<minor>`` entry; a partition's queue sits in its disk's folder."""
    disk = root / "devices" / "disk"
    node = disk / "part1" if partition else disk
    node.mkdir(parents=True, exist_ok=True)
    (root / "block").mkdir(exist_ok=True)
    (root / "block" / device).symlink_to(node)
    queue = disk / "queue"
    queue.mkdir(exist_ok=True)
    for name, value in (("read_ahead_kb", window_kib), ("max_sectors_kb", request_kib)):
        if value is not None:
            (queue / name).write_text(f"{value}\n")


@pytest.mark.parametrize(
    ("window_kib", "request_kib", "partition", "expected"),
    [
        (8192, 4096, False, 8 * 1024**2),  # this machine's disk: the window
        (128, 1280, False, 1280 * 1024),  # a default window, a larger request: the request
        (128, 1280, True, 1280 * 1024),  # a partition: its disk's queue
        (65536, 4096, False, readahead.HINT_BYTES),  # capped
        (128, 128, False, readahead.FALLBACK_HINT_BYTES),  # never smaller than the floor
        (None, None, False, readahead.FALLBACK_HINT_BYTES),  # sysfs does not say
    ],
)
def test_each_hint_asks_for_what_the_device_reads_in_one_go(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    window_kib: int | None,
    request_kib: int | None,
    partition: bool,
    expected: int,
) -> None:
    _fake_queue(tmp_path, "259:1", window_kib, request_kib, partition)
    monkeypatch.setattr(readahead, "SYSFS_BLOCK", str(tmp_path / "block"))
    readahead.hint_bytes.cache_clear()
    try:
        assert readahead.hint_bytes(os.makedev(259, 1)) == expected
        assert readahead.hint_bytes(os.makedev(8, 99)) == readahead.FALLBACK_HINT_BYTES  # no such device
    finally:
        readahead.hint_bytes.cache_clear()


def test_a_file_is_read_in_pieces_after_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _write(tmp_path / "x.safetensors", 5 * 1024**2 + 7)
    monkeypatch.setattr(readahead, "READ_BYTES", 2 * 1024**2)
    hints: list[tuple[int, int]] = []
    reads: list[tuple[int, int]] = []
    readahead.hint(
        [name],
        readahead.BUDGET,
        lambda fd, offset, length: hints.append((offset, length)),
        lambda fd, offset, length: reads.append((offset, length)),
    )
    head, mib = readahead.HEAD_BYTES, 1024**2
    assert hints == [(0, head)]  # the start, where the header is: hinted
    assert reads == [(head, 2 * mib), (head + 2 * mib, 2 * mib), (head + 4 * mib, mib - head + 7)]


def _evicted(path: str) -> bool:
    evict(path)
    return not any(_cached(path))


def _cached(path: str) -> list[bool]:
    from reshard.execute.pagecache import Residency

    fd = os.open(path, os.O_RDONLY)
    try:
        residency = Residency.of(fd)
        assert residency is not None
        try:
            return residency.pages(0, residency.size)
        finally:
            residency.close()
    finally:
        os.close(fd)


def test_the_bulk_is_read_through_dev_null_into_the_page_cache(tmp_path: Path) -> None:
    """Read as ``cp`` reads (large folios, a few requests at a time), not hinted all at once."""
    name = _write(tmp_path / "x.safetensors", 6 * 1024**2)
    if not _evicted(name):
        pytest.skip("this filesystem keeps its pages (tmpfs)")
    budget = readahead.HEAD_BYTES + 2 * 1024**2
    assert readahead.hint([name], budget) == budget
    pages = _cached(name)
    wanted = budget // os.sysconf("SC_PAGE_SIZE")
    assert all(pages[:wanted])


def test_where_sendfile_is_refused_the_rest_is_hinted_in_device_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _write(tmp_path / "x.safetensors", 5 * 1024**2 + 7)
    monkeypatch.setattr(readahead, "hint_bytes", lambda device: 2 * 1024**2)
    sent: list[int] = []

    def sendfile(out: int, fd: int, offset: int, count: int) -> int:
        sent.append(offset)
        raise OSError(22, "Invalid argument")  # what a platform without it says

    monkeypatch.setattr(os, "sendfile", sendfile)
    hints: list[tuple[int, int]] = []
    monkeypatch.setattr(readahead, "_willneed", lambda fd, offset, length: hints.append((offset, length)))
    readahead.hint([name], readahead.BUDGET)
    head, mib = readahead.HEAD_BYTES, 1024**2
    assert sent == [head]  # tried once, then not again
    assert hints == [(0, head), (head, 2 * mib), (head + 2 * mib, 2 * mib), (head + 4 * mib, mib - head + 7)]


def test_the_starts_of_many_files_come_first_within_the_budget(tmp_path: Path) -> None:
    head = readahead.HEAD_BYTES
    for r in range(5):
        _write(tmp_path / f"rank_{r}" / "x.safetensors", 4 * head)
    _write(tmp_path / "rank_5" / "small.safetensors", head // 2)  # smaller than a start: hinted whole once
    calls: list[tuple[str, int, int]] = []

    def record(fd: int, offset: int, length: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    readahead.hint([str(tmp_path)], head * 5 // 2, record, record)
    assert [(os.path.basename(os.path.dirname(n)), o, n_) for n, o, n_ in calls] == [
        ("rank_0", 0, head),
        ("rank_1", 0, head),
        ("rank_2", 0, head // 2),  # the budget ends inside the third start: no file whole
    ]
    calls.clear()
    readahead.hint([str(tmp_path / "rank_5")], readahead.BUDGET, record, record)
    assert [(o, n) for _, o, n in calls] == [(0, head // 2)]


def test_two_sources_share_the_budget(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.safetensors", 10 * 1024**2)
    b = _write(tmp_path / "b.safetensors", 10 * 1024**2)
    seen: dict[str, int] = {}

    def advise(fd: int, offset: int, length: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        seen[name] = seen.get(name, 0) + length

    readahead.hint([a, b], 8 * 1024**2, advise, advise)
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


# (argv, what the command reads ahead once parsed, what ``cli.early`` reads off the words before)
READS = [
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["transform", "--src", "SRC", "--dst", "DST", "--dst-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["transform", "--src=SRC", "--dst", "DST", "--dst-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["transform", "--dst-strategy", "s.ckpt", "SRC", "DST"], ["SRC"], []),  # a flag first: after parsing
    (["transform", "SRC", "DST", "--src-strat", "s.ckpt", "--dst-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--ranks", "0-1"], [], []),
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--ranks=0-1"], [], []),
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--executor", "ray"], [], []),
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--execu", "ray"], [], []),
    (["transform", "SRC", "DST", "--dst-strategy", "s.ckpt", "--executor", "local"], ["SRC"], []),
    (["unify", "SRC", "DST", "--src-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["unify", "--src-strategy", "s.ckpt", "SRC", "DST"], ["SRC"], []),
    (["convert", "SRC", "DST", "--to", "safetensors"], ["SRC"], ["SRC"]),
    (["split", "SRC", "DST", "--dst-strategy", "s.ckpt"], ["SRC"], ["SRC"]),
    (["verify", "A", "B"], ["A", "B"], ["A", "B"]),
    (["verify", "A", "--dequantize", "bf16", "B"], ["A", "B"], []),
    (["inspect", "SRC"], [], []),  # headers only
    (["plan", "SRC", "DST", "--dst-strategy", "s.ckpt"], [], []),  # no data read
]


@pytest.mark.parametrize(("argv", "expected", "_"), READS)
def test_the_command_reads_ahead_what_it_reads_whole(argv: list[str], expected: list[str], _: list[str]) -> None:
    assert _read_ahead(build_parser().parse_args(argv)) == expected


@pytest.mark.parametrize(("argv", "parsed", "named"), READS)
def test_the_words_name_the_sources_before_the_parser_or_nothing(
    argv: list[str], parsed: list[str], named: list[str]
) -> None:
    """``cli.early`` reads the unambiguous forms only, and never a source the parsed command would not read."""
    assert early.sources(argv) == named
    assert named in ([], parsed)


def test_the_command_reads_ahead_once_from_its_words_else_after_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reshard import cli

    job = make_job(str(tmp_path / "job"), SMALL)
    started: list[list[str]] = []
    small: list[list[str]] = []

    def start(paths: list[str], small_files: tuple[str, ...] = ()) -> None:
        started.append(list(paths))
        small.append(list(small_files))

    monkeypatch.setattr(cli.readahead, "start", lambda paths, small=(): start(paths, small))
    assert cli.main(["convert", job["r8"], str(tmp_path / "a"), "--to", "safetensors", "-q"]) == 0
    assert started == [[job["r8"]]]  # from the words, before the parser was built; not again
    started.clear()
    assert cli.main(["convert", "--to", "safetensors", "-q", job["r8"], str(tmp_path / "b")]) == 0
    assert started == [[], [job["r8"]]]  # nothing sure in the words: after parsing
    started.clear()
    small.clear()
    argv = ["transform", job["r8"], str(tmp_path / "c"), "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    assert cli.main([*argv, "-q"]) == 0
    assert started == [[job["r8"]]] and small == [[job["s8"], job["s4"]]]  # the strategies first, whole
    started.clear()
    small.clear()
    assert cli.main(["unify", "-q", "--src-strategy", job["s8"], job["r8st"], str(tmp_path / "d")]) == 0
    assert started == [[], [job["r8st"]]] and small == [[], [job["s8"]]]  # after parsing: from the arguments


def test_the_dropin_reads_ahead_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard import mindspore as ms
    from reshard.mindspore import dropin

    job = make_job(str(tmp_path / "job"), SMALL)
    started: list[tuple[list[str], list[str]]] = []
    monkeypatch.setattr(dropin.readahead, "start", lambda paths, small=(): started.append((list(paths), list(small))))
    ms.transform_checkpoints(job["r8"], str(tmp_path / "r4"), "checkpoint_", job["s8"], job["s4"])
    ms.ckpt_to_safetensors(job["r8"], str(tmp_path / "st"))
    ms.unified_safetensors(job["r8st"], job["s8"], str(tmp_path / "unified"))
    assert started == [([job["r8"]], [job["s8"], job["s4"]]), ([job["r8"]], []), ([job["r8st"]], [job["s8"]])]


def test_the_bulk_waits_while_an_index_runs(tmp_path: Path) -> None:
    """``paused`` holds the bulk between two of its reads (the heads are hinted all the same), and
    the reads go on once the last holder leaves."""
    import threading

    name = _write(tmp_path / "x.ckpt", 3 * readahead.HEAD_BYTES)
    hints: list[int] = []
    reads: list[int] = []
    with readahead.paused():
        with readahead.paused():  # two indexes at once: the bulk waits for both
            worker = threading.Thread(
                target=readahead.hint,
                args=([name], readahead.BUDGET, lambda fd, o, n: hints.append(o), lambda fd, o, n: reads.append(o)),
            )
            worker.start()
            worker.join(0.1)
            assert hints == [0] and reads == []
        worker.join(0.05)
        assert reads == []
    worker.join(5)
    assert reads == [readahead.HEAD_BYTES]


def test_stop_ends_the_bulk_of_a_read_ahead_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(readahead, "READ_BYTES", 1024**2)
    name = _write(tmp_path / "x.ckpt", 4 * 1024**2)
    first, go_on = threading.Event(), threading.Event()
    reads: list[int] = []
    ended: list[str] = []

    def read(fd: int, offset: int, length: int) -> None:
        reads.append(offset)
        first.set()
        go_on.wait(5)

    def bulk() -> None:
        try:
            readahead.hint([name], readahead.BUDGET, lambda fd, o, n: None, read)
            ended.append("finished")
        except Exception as exc:  # what the read-ahead's thread swallows: it ends there
            ended.append(type(exc).__name__)

    worker = threading.Thread(target=bulk)
    worker.start()
    assert first.wait(5)
    readahead.stop()  # the executor's own read-ahead takes over
    go_on.set()
    worker.join(5)
    assert reads == [readahead.HEAD_BYTES]  # the read under way finished; no other began
    assert ended == ["_Stopped"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["transform", "SRC", "DST", "--src-strategy", "a", "--dst-strategy=b"], ["a", "b"]),
        (["unify", "SRC", "DST", "--src-strategy", "a"], ["a"]),
        (["split", "SRC", "DST", "--dst-strategy", "b"], ["b"]),
        (["transform", "SRC", "DST", "--src-strategy", "--dst-strategy", "b"], ["b"]),  # no value: nothing
        (["transform", "SRC", "DST", "--src-strat", "a"], []),  # abbreviated: after parsing
        (["transform", "SRC", "DST", "--src-strategy", "a", "--ranks", "0"], []),
        (["inspect", "SRC", "--src-strategy", "a"], []),
    ],
)
def test_the_words_name_the_strategies_read_whole(argv: list[str], named: list[str]) -> None:
    assert early.strategies(argv) == named


def test_strategy_files_are_hinted_whole_before_any_source(tmp_path: Path) -> None:
    source = _write(tmp_path / "rank_0" / "x.ckpt", 2 * readahead.HEAD_BYTES)
    strategy = _write(tmp_path / "s.ckpt", 3000)
    stages = tmp_path / "stages"
    for k in (10, 2):
        _write(stages / f"stage_{k}.ckpt", 100)
    calls: list[tuple[str, int, int]] = []

    def advise(fd: int, offset: int, length: int) -> None:
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))

    readahead.hint([str(tmp_path / "rank_0")], readahead.BUDGET, advise, advise, small=[strategy, str(stages)])
    assert calls[:4] == [
        ("s.ckpt", 0, 3000),
        ("stage_2.ckpt", 0, 100),
        ("stage_10.ckpt", 0, 100),
        ("x.ckpt", 0, readahead.HEAD_BYTES),
    ]
    assert readahead.small_files([str(tmp_path / "missing"), source]) == [source]


def test_an_index_and_the_replica_check_hold_the_bulk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their small reads go first: both take ``paused`` while they read (a merge of 8 rank files)."""
    import contextlib

    from reshard import api

    job = make_job(str(tmp_path / "job"), SMALL)
    held: list[str] = []
    real = readahead.paused

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        import traceback

        held.append(traceback.extract_stack()[-3].name)
        with real():
            yield

    monkeypatch.setattr(readahead, "paused", recording)
    api.transform(job["r8"], str(tmp_path / "full"), job["s8"], None)
    assert "indexed" in held and "check_replicas" in held
