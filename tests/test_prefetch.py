"""Reading an output's sources ahead in the copy's order (``execute.prefetch``).

The byte ranges a tensor reads are checked against a naive reference (materialise the source with
``arange``, take the box, look at its smallest and largest element); the reading thread against a
fake reader: work order, the window, pieces, and that a copy thread never waits for good on a
reader that failed or a file given up. A reshard with it writes the same bytes as without it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import api, dtypes, readahead
from reshard.execute import local, prefetch
from reshard.execute.options import RunOptions
from reshard.plan import Copy, Plan, TensorPlan
from tests.trust_helpers import make_job, tree


@st.composite
def boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Copy]:
    """A source shape and a copy of one box of it, its axes permuted or not."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    start = tuple(draw(st.integers(0, n - 1)) for n in shape)
    src_lengths = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, start, strict=True))
    perm = tuple(draw(st.permutations(range(len(shape))))) if draw(st.booleans()) else None
    lengths = tuple(src_lengths[axis] for axis in perm) if perm is not None else src_lengths
    return shape, Copy(0, "t", start, (0,) * len(shape), lengths, src_perm=perm)


@settings(max_examples=300, deadline=None)
@given(boxes(), st.sampled_from([1, 2, 4]))
def test_a_box_extent_runs_from_its_first_to_its_last_element(box: tuple[tuple[int, ...], Copy], item: int) -> None:
    shape, c = box
    source = np.arange(int(np.prod(shape))).reshape(shape)
    taken = source[tuple(slice(s, s + n) for s, n in zip(c.src_start, c.src_lengths, strict=True))]
    assert prefetch.box_extent(c, shape, item) == (int(taken.min()) * item, (int(taken.max() - taken.min()) + 1) * item)


def test_a_tensor_reads_its_boxes_through_the_segments_neighbours_merged() -> None:
    f32 = dtypes.FLOAT32
    rows = Copy(0, "w", (2, 0), (0, 0), (2, 4))  # rows 2-3 of a 4 x 4 source: bytes 32-63
    cols = Copy(1, "w", (0, 1), (0, 2), (4, 2))  # columns 1-2 of the other: bytes 4 to 60
    t = TensorPlan("w", f32, (4, 4), (rows, cols), 64)
    segments = {"a": ((1000, 40), (2000, 24)), "b": ((5000, 64),)}  # "a" stored in two pieces
    plan = Plan("transform", ("a", "b"), ())
    reads = prefetch.tensor_reads(t, plan, lambda path, name: (segments[path], (4, 4), 4))
    assert reads == [("a", 1032, 8), ("a", 2000, 24), ("b", 5004, 56)]
    assert prefetch.tensor_reads(t, plan, lambda path, name: None) is None  # not a plain file: nothing
    assert prefetch.merged([("a", 0, 10), ("a", 10, 5), ("a", 4, 2), ("b", 15, 1), ("a", 16, 1)]) == [
        ("a", 0, 15),
        ("a", 16, 1),
        ("b", 15, 1),
    ]


class _Reader:
    """A fake reader: records each call, optionally fails or waits on a gate."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.entered = self.left = 0
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Callable[[str, int, int], None]]:
        self.entered += 1
        try:
            yield self.read
        finally:
            self.left += 1

    def read(self, path: str, offset: int, length: int) -> None:
        self.gate.wait(5)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise OSError("the disk went away")
        self.calls.append((path, offset, length))


def _settled(reader: _Reader, count: int) -> list[tuple[str, int, int]]:
    """The calls once there are ``count`` of them and no more come within 50 ms."""
    deadline = time.monotonic() + 5
    while len(reader.calls) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    return list(reader.calls)


def test_tensors_are_read_in_work_order_and_no_further_than_the_window() -> None:
    reads = [[(f"f{k % 2}", 100 * k, 100)] for k in range(6)]  # 100 bytes a tensor
    reader = _Reader()
    ahead = prefetch.Prefetcher(reads, window=250, reader=reader).start()
    try:
        assert _settled(reader, 2) == [("f0", 0, 100), ("f1", 100, 100)]  # 200 bytes: the third is past 250
        ahead.take(0)
        ahead.take(1)  # tensors 1 and 2 are within 250 bytes of where the copy stands, 3 is not
        assert _settled(reader, 3) == [(f"f{k % 2}", 100 * k, 100) for k in range(3)]
        ahead.take(5)  # a copy thread far ahead: everything up to it is read, whatever the window
        assert _settled(reader, 6) == [(f"f{k % 2}", 100 * k, 100) for k in range(6)]
    finally:
        ahead.close()
    assert _wait_for(lambda: reader.left == 1) and reader.entered == 1


def _taking_behind_a_closed_gate(
    reads: list[list[tuple[str, int, int]]],
) -> tuple[_Reader, prefetch.Prefetcher, threading.Thread, threading.Event]:
    """A prefetcher whose reader waits at its gate, and a copy thread taking the second tensor."""
    reader = _Reader()
    reader.gate.clear()
    ahead = prefetch.Prefetcher(reads, reader=reader).start()
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (ahead.take(1), taken.set()))
    waiter.start()
    return reader, ahead, waiter, taken


def test_a_copy_thread_waits_for_its_tensor_then_finds_it_read() -> None:
    reader, ahead, waiter, taken = _taking_behind_a_closed_gate([[("f", 0, 10)], [("f", 10, 10)]])
    assert not taken.wait(0.1)  # nothing read yet
    reader.gate.set()
    assert taken.wait(5)
    assert reader.calls == [("f", 0, 10), ("f", 10, 10)]
    waiter.join()
    ahead.close()


def test_a_long_range_is_read_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "PIECE_BYTES", 4)
    reader = _Reader()
    ahead = prefetch.Prefetcher([[("f", 100, 10)]], reader=reader).start()
    ahead.take(0)
    assert reader.calls == [("f", 100, 4), ("f", 104, 4), ("f", 108, 2)]
    ahead.close()


def test_a_failed_reader_leaves_the_reading_to_the_copy_threads() -> None:
    reader = _Reader(fail_at=1)
    ahead = prefetch.Prefetcher([[("f", 0, 1)], [("f", 1, 1)], [("f", 2, 1)]], reader=reader).start()
    for k in range(3):
        ahead.take(k)  # returns: the reading ended quietly at the second tensor
    assert reader.calls == [("f", 0, 1)]
    assert _wait_for(lambda: reader.left == 1)
    ahead.close()


def test_a_file_given_up_frees_the_copy_threads_waiting_for_bytes() -> None:
    reader, ahead, waiter, freed = _taking_behind_a_closed_gate([[("f", 0, 1)], [("f", 1, 1)]])
    assert not freed.wait(0.05)
    ahead.close()
    assert freed.wait(5)
    reader.gate.set()
    waiter.join()
    assert _wait_for(lambda: reader.left == 1)
    assert len(reader.calls) <= 1  # the read under way finished; no other began


def _wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_reshard_reads_ahead_every_byte_it_copies_and_writes_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 rank files merged to one: the copy threads took every tensor from the read-ahead, the
    start-up read-ahead was ended, and the output is the bytes of a run without either."""
    job = make_job(str(tmp_path / "job"))
    made: list[prefetch.Prefetcher] = []
    taken: list[int] = []
    stops: list[int] = []
    real_prefetcher, real_take, real_stop = prefetch.Prefetcher, prefetch.Prefetcher.take, readahead.stop

    def recording(*args: object, **kwargs: object) -> prefetch.Prefetcher:
        made.append(real_prefetcher(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(local, "Prefetcher", recording)
    monkeypatch.setattr(prefetch.Prefetcher, "take", lambda self, k: (taken.append(k), real_take(self, k))[1])
    monkeypatch.setattr(readahead, "stop", lambda: (stops.append(1), real_stop())[1])
    api.transform(job["r8"], str(tmp_path / "full"), job["s8"], None, run=RunOptions(workers=3))
    assert len(made) == 1 and stops == [1]
    assert sorted(taken) == list(range(len(made[0]._reads)))  # every tensor, once
    sources = {str(p) for p in Path(job["r8"]).glob("rank_*/*.ckpt")}
    assert {path for ranges in made[0]._reads for path, _, _ in ranges} <= sources
    monkeypatch.setattr(local, "_prefetcher", lambda *args: None)
    api.transform(job["r8"], str(tmp_path / "plain"), job["s8"], None, run=RunOptions(workers=3))
    ours = {k: v for k, v in tree(str(tmp_path / "full")).items() if "manifest" not in k}
    assert ours == {k: v for k, v in tree(str(tmp_path / "plain")).items() if "manifest" not in k}


@pytest.mark.parametrize("mode", ["dequantize", "quantize"])
def test_computed_tensors_read_their_stored_weights_and_scales_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``--dequantize`` reads each FP8 weight and its scale ahead, ``--quantize`` each bf16 weight once (its
    values and its scale tensor both read it); the outputs are the bytes of a run without it."""
    from reshard.plan.quantized import Precision
    from tests.lowprec_fixtures import bf16_model, fp8_model

    source = fp8_model(tmp_path / "fp8") if mode == "dequantize" else bf16_model(tmp_path / "bf16")
    precision = Precision(dequantize="bf16") if mode == "dequantize" else Precision(quantize="fp8-block")
    made: list[prefetch.Prefetcher] = []
    real_prefetcher = prefetch.Prefetcher

    def recording(*args: object, **kwargs: object) -> prefetch.Prefetcher:
        made.append(real_prefetcher(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    def run(out: str) -> bytes:
        api.transform(
            str(source),
            str(tmp_path / out),
            output=api.OutputSpec(format="hf"),
            tensors=api.TensorOptions(precision=precision),
            run=RunOptions(workers=2),
        )
        return (tmp_path / out / "model.safetensors").read_bytes()

    monkeypatch.setattr(local, "Prefetcher", recording)
    ahead = run("ahead")
    assert len(made) == 1
    files = {path for ranges in made[0]._reads for path, _, _ in ranges}
    assert files == {str(source / "model.safetensors")}
    read = sum(length for ranges in made[0]._reads for _, _, length in ranges)
    stored = (source / "model.safetensors").stat().st_size
    assert stored * 0.9 < read <= stored  # every weight once (--quantize's values and scales share theirs)
    monkeypatch.setattr(local, "_prefetcher", lambda *args: None)
    assert ahead == run("plain")
