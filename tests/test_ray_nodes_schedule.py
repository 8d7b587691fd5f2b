"""The node schedule without Ray: byte runs of boxes, merged ranges, placement files, writer choice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard import dtypes
from reshard.errors import UsageError
from reshard.execute.nodes import (
    SourceFacts,
    TensorFacts,
    box_runs,
    load_placement,
    merge_runs,
    placement_from_json,
    schedule,
)
from reshard.plan import Copy, FilePlan, Plan, TensorPlan


@pytest.mark.parametrize(
    ("shape", "start", "lengths"),
    [
        ((4, 6), (1, 0), (2, 6)),
        ((4, 6), (0, 2), (4, 3)),
        ((2, 3, 4), (1, 1, 0), (1, 2, 4)),
        ((2, 3, 4), (0, 0, 1), (2, 3, 2)),
        ((5,), (2,), (3,)),
    ],
)
def test_box_runs_cover_exactly_the_box(
    shape: tuple[int, ...], start: tuple[int, ...], lengths: tuple[int, ...]
) -> None:
    itemsize = 4
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(s, s + n) for s, n in zip(start, lengths, strict=True))] = True
    expected = np.repeat(mask.reshape(-1), itemsize)
    got = np.zeros_like(expected)
    for offset, length in box_runs(shape, itemsize, start, lengths):
        assert not got[offset : offset + length].any()  # no byte listed twice
        got[offset : offset + length] = True
    assert (got == expected).all()


def test_merge_runs_joins_overlaps_and_neighbours() -> None:
    assert merge_runs([(10, 5), (0, 4), (4, 2), (12, 10), (30, 1)]) == [(0, 6), (10, 12), (30, 1)]


def test_placement_file(tmp_path: Any) -> None:
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "nodes": {"node_a": ["/data/ck/rank_0"], "10.0.0.2": ["/data/ck/rank_1/x.ckpt"]},
                "writers": {"3": "node_a"},
            }
        )
    )
    placement = load_placement(str(path))
    assert placement.nodes_holding("/data/ck/rank_0/a.ckpt") == ["node_a"]
    assert placement.nodes_holding("/data/ck/rank_0x/a.ckpt") == []  # a prefix of a name is no folder
    assert placement.nodes_holding("/data/ck/rank_1/x.ckpt") == ["10.0.0.2"]
    assert placement.writers == {3: "node_a"}
    for bad in (
        [],
        {"nodes": []},
        {"nodes": {"a": "x"}},
        {"nodes": {}, "writers": {"r0": "a"}},
        {"nodes": {}, "more": 1},
    ):
        with pytest.raises(UsageError):
            placement_from_json(bad)


def _plan() -> tuple[Plan, dict[int, SourceFacts]]:
    """Two sources of a (4, 2) float32 tensor's halves; output 0 reads both, output 1 one row of each."""
    f32 = dtypes.FLOAT32
    facts = {i: SourceFacts(100, {"w": TensorFacts((2, 2), f32, 4, ((20, 16),))}) for i in (0, 1)}
    full = TensorPlan(
        "w", f32, (4, 2), (Copy(0, "w", (0, 0), (0, 0), (2, 2), True), Copy(1, "w", (0, 0), (2, 0), (2, 2), True)), 32
    )
    rows = TensorPlan(
        "w", f32, (2, 2), (Copy(0, "w", (1, 0), (0, 0), (1, 2)), Copy(1, "w", (1, 0), (1, 0), (1, 2))), 16
    )
    files = (FilePlan("/o/a.ckpt", "ckpt", (full,), rank=0), FilePlan("/o/b.ckpt", "ckpt", (rows,), rank=1))
    return Plan("t", ("/s/0.ckpt", "/s/1.ckpt"), files), facts


def test_schedule_writers_and_minimum() -> None:
    plan, facts = _plan()
    sched = schedule(plan, {0: ["A"], 1: ["B"]}, facts)
    assert sched.writers == ("A", "A")  # ties go to the first node in sorted order
    [fetch] = sched.fetches["A"]
    assert (fetch.source, fetch.reader, fetch.runs) == (1, "B", ((20, 16),))  # row 1 needed twice: fetched once
    assert sched.cross_node_bytes == 16 and sched.nodes_used() == {"A", "B"}
    named = schedule(plan, {0: ["A"], 1: ["B", "C"]}, facts, {1: "C"})
    assert named.writers == ("A", "C")
    assert named.cross_node_bytes == 16 + 8  # A needs all of source 1, C row 1 of source 0
    with pytest.raises(UsageError, match="no node holds"):
        schedule(plan, {0: ["A"]}, facts)


def test_pieces_stay_within_the_window() -> None:
    from reshard.execute.nodes import Fetch
    from reshard.execute.ray_nodes import _pieces

    fetch = Fetch(0, "A", ((0, 10), (20, 3), (40, 25)))
    pieces = _pieces(fetch, 8)
    assert all(sum(n for _, n in p) <= 8 for p in pieces)
    covered = [b for p in pieces for o, n in p for b in range(o, o + n)]
    assert covered == [b for o, n in fetch.runs for b in range(o, o + n)]  # every byte once, in order


def test_encrypted_source_is_refused_in_one_line(tmp_path: Any) -> None:
    from reshard import api
    from reshard.errors import UnsupportedError
    from reshard.execute.nodes import source_facts
    from reshard.execute.options import WriteOptions
    from reshard.synthetic import full_model
    from tests.trust_helpers import SMALL, save_ckpt

    plain, enc = str(tmp_path / "plain" / "m.ckpt"), str(tmp_path / "enc")
    save_ckpt(plain, full_model(SMALL))
    key = b"k" * 16
    api.convert(plain, enc, "ckpt", write=WriteOptions(enc_key=key))
    [name] = [n for n in os.listdir(enc) if n.endswith(".ckpt")]
    with pytest.raises(UnsupportedError, match="--no-shared-disk") as info:
        source_facts(os.path.join(enc, name), api.ReadOptions(dec_key=key))
    assert "\n" not in str(info.value)


def test_cli_bad_placement_file_exits_2(tmp_path: Any) -> None:
    """``reshard plan --placement`` needs no cluster: a bad file is one line, exit 2."""
    from tests.trust_helpers import make_job, run_cli

    job = make_job(str(tmp_path / "job"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": {"a": "not a list"}}')
    args = ["plan", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    proc = run_cli(*args, "--dst", str(tmp_path / "o"), "--placement", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "must list paths" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_stale_temps_are_only_this_outputs_leftovers(tmp_path: Path) -> None:
    """What a retried writer removes: the killed attempt's ``.<name>.<8 hex>.reshard-tmp`` of this
    very output, never another output's temporary file or the output itself."""
    from reshard.formats.base import stale_temps

    names = [
        ".checkpoint_2.ckpt.2991b1f5.reshard-tmp",  # this output's leftover
        ".checkpoint_20.ckpt.2991b1f5.reshard-tmp",  # another output's
        ".checkpoint_2.ckpt.notahex.reshard-tmp",  # not a name reshard makes
        "checkpoint_2.ckpt",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert stale_temps(str(tmp_path / "checkpoint_2.ckpt")) == [str(tmp_path / names[0])]
    assert stale_temps(str(tmp_path / "missing" / "x.ckpt")) == []
