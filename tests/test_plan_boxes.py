"""``plan_boxes`` (reshard.plan.boxes) against the layout planners, and uneven chunks end to end.

On random MindSpore layouts (flat and list maps, optimizer shards, device counts that do not divide
each other) the box planner, given each source tensor as the chunks of its rank files
(``source_chunks``) and each destination rank's box (``rank_boxes``), must plan:

* **split** (full tensors -> ranks): the *same* plan as ``plan_split`` (bulk and reference loop),
  equal as plain data, sources in the same order;
* **unify** (ranks -> full tensors): the *same* tensors as the reference planner's
  ``TransformPlanner.transform_one`` (every copy from the same file), which ``plan_unify`` uses;
* **transform** (ranks -> ranks): plans equal *copy for copy* to ``plan_transform`` (bulk) and to
  ``TransformPlanner.plan_rank`` (reference): the same copies in the same order, each reading the
  same box of the global tensor, from the same file or from a replica holding the same box. The
  replica differs where MindSpore picks, per destination rank, the copy whose coordinates on the
  kept device axes are the destination's (docs/formats.md §3.5); chunks have one holder per box.

Then real files: safetensors holding uneven ``torch.chunk`` shards (several per file) are planned
into full tensors and into another uneven chunking, run by the local executor and compared with
numpy.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import api, dtypes
from reshard.errors import LayoutError, UsageError
from reshard.formats import rank_dirs
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy
from reshard.layout import ParamLayout, rank_boxes
from reshard.layout.chunks import ChunkedTensor, even_boxes, grid_boxes, whole_box, whole_chunks
from reshard.plan import (
    FilePlan,
    Plan,
    SourceFile,
    SourceTensor,
    TransformPlanner,
    plan_split,
    plan_transform,
    validate_plan,
)
from reshard.plan.boxes import (
    BoxTensors,
    OutputFile,
    Target,
    assembled_tensor,
    plan_boxes,
    source_chunks,
    strategy_chunks,
)
from reshard.plan.model import SourcePaths, output_metadata
from reshard.plan.split import _plan_split_reference, _SplitJob
from reshard.plan.validate import PlanError
from reshard.sources.registry import open_source
from tests import checkpoint2_fixtures as fx
from tests.test_plan_bulk import DTYPES, PARAMS, layouts  # random layouts over 2, 4, 6 or 8 devices


@st.composite
def strategy_items(draw: st.DrawFn, devices: int) -> dict[str, ParamLayout]:
    if devices == 1:
        return {name: ParamLayout((1,), (-1,) * len(shape)) for name, shape in PARAMS.items()}
    return {name: draw(layouts(devices, shape)) for name, shape in PARAMS.items()}


def rank_files(items: dict[str, ParamLayout], root: str) -> dict[int, SourceFile]:
    """One file per rank holding its slice of every parameter (shapes only)."""
    n = next(iter(items.values())).device_num
    files = {}
    for r in range(n):
        tensors = {}
        for name, p in items.items():
            shape = tuple(b - a for a, b in rank_boxes(p, PARAMS[name])[r])
            tensors[name] = SourceTensor(DTYPES[name], shape, math.prod(shape) * DTYPES[name].itemsize)
        files[r] = SourceFile(f"{root}/rank_{r}/checkpoint_{r}.safetensors", r, tensors)
    return files


def rank_chunks(items: dict[str, ParamLayout], files: dict[int, SourceFile]) -> list[ChunkedTensor]:
    return [source_chunks(name, p, PARAMS[name], files) for name, p in items.items()]


def global_copies(plan: Plan, origins: dict[str, dict[str, tuple[int, ...]]]) -> dict[tuple[str, str], list]:
    """Per (output, tensor): its copies as (global source start, dst start, lengths, whole, file)."""
    out = {}
    for f in plan.files:
        for t in f.tensors:
            rows = []
            for c in t.copies:
                path = plan.sources[c.source]
                start = tuple(o + s for o, s in zip(origins[c.tensor][path], c.src_start, strict=True))
                rows.append((start, c.dst_start, c.lengths, c.whole_source, path))
            out[(f.path, t.name)] = (t.dtype, t.shape, t.nbytes, rows)
    return out


def origins_of(chunks: list[ChunkedTensor]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Per tensor, per file: where the box its file holds starts in the global tensor."""
    return {c.name: {f: tuple(a for a, _ in b) for f, b in zip(c.files, c.boxes, strict=True)} for c in chunks}


def all_origins(items: dict[str, ParamLayout], files: dict[int, SourceFile]) -> dict[str, dict[str, tuple]]:
    return {
        name: {f.path: tuple(a for a, _ in rank_boxes(p, PARAMS[name])[r]) for r, f in files.items()}
        for name, p in items.items()
    }


def held_boxes(items: dict[str, ParamLayout], files: dict[int, SourceFile]) -> dict[tuple[str, str], tuple]:
    return {(name, f.path): rank_boxes(p, PARAMS[name])[r] for name, p in items.items() for r, f in files.items()}


def box_transform(items, dst_items, files, root) -> Plan:
    n_dst = next(iter(dst_items.values())).device_num
    outputs = [
        OutputFile(
            rank_dirs.rank_output(root, r, "checkpoint_", "safetensors"),
            "safetensors",
            output_metadata("safetensors"),
            r,
        )
        for r in range(n_dst)
    ]
    targets = [Target(name, rank_boxes(dst_items[name], PARAMS[name])) for name in files[0].tensors]
    return plan_boxes(rank_chunks(items, files), outputs, targets, "transform")


def assert_copy_for_copy(box: Plan, ref: Plan, items, files) -> int:
    """Equal copies, each from a file holding the same global box; returns how many files differ."""
    origins = all_origins(items, files)
    held = held_boxes(items, files)
    mine, theirs = global_copies(box, origins), global_copies(ref, origins)
    assert mine.keys() == theirs.keys()
    replicas = 0
    for key, (dtype, shape, nbytes, rows) in theirs.items():
        got = mine[key]
        assert got[:3] == (dtype, shape, nbytes), key
        assert [r[:4] for r in got[3]] == [r[:4] for r in rows], key
        for (*_, a), (*_, b) in zip(got[3], rows, strict=True):
            if a != b:
                assert held[(key[1], a)] == held[(key[1], b)], (key, a, b)  # a replica of the same box
                replicas += 1
    return replicas


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_transform_copy_for_copy(data: st.DataObject) -> None:
    n_src, n_dst = data.draw(st.sampled_from([(2, 4), (4, 2), (4, 4), (8, 2), (2, 8), (4, 6), (6, 4), (1, 4), (4, 1)]))
    items, dst_items = data.draw(strategy_items(n_src)), data.draw(strategy_items(n_dst))
    files = rank_files(items, "/src")
    ref = plan_transform(files, make_strategy(items), make_strategy(dst_items), "/dst", "checkpoint_", "safetensors")
    box = box_transform(items, dst_items, files, "/dst")
    validate_plan(box)
    assert [(f.path, f.format, f.metadata, f.rank) for f in box.files] == [
        (f.path, f.format, f.metadata, f.rank) for f in ref.files
    ]
    assert_copy_for_copy(box, ref, items, files)
    planner = TransformPlanner(files, make_strategy(items), make_strategy(dst_items))
    interned = SourcePaths()
    loop = tuple(FilePlan(f.path, f.format, planner.plan_rank(f.rank, interned), f.metadata, f.rank) for f in ref.files)
    assert_copy_for_copy(box, Plan("transform", tuple(interned.paths), loop), items, files)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_unify_same_tensors_as_the_reference(data: st.DataObject) -> None:
    """Also when a save without redundant copies left a slice in one rank's file only."""
    n_src = data.draw(st.sampled_from([1, 2, 4, 6, 8]))
    items = data.draw(strategy_items(n_src))
    files = rank_files(items, "/src")
    planner = TransformPlanner(files, make_strategy(items), None)
    ref_paths, box_paths = SourcePaths(), SourcePaths()
    for name, p in items.items():
        holders = {r: f for r, f in files.items()}
        by_box: dict[tuple, list[int]] = {}
        for r, box in enumerate(rank_boxes(p, PARAMS[name])):
            by_box.setdefault(box, []).append(r)
        for ranks in by_box.values():  # drop some replicas, keep one
            keep = data.draw(st.sampled_from(ranks))
            for r in ranks:
                if r != keep and data.draw(st.booleans()):
                    del holders[r]
        want = planner.transform_one(name, p, None, holders, 0, ref_paths)
        got = assembled_tensor(box_paths, source_chunks(name, p, PARAMS[name], holders), whole_box(PARAMS[name]))
        assert got == want
    assert box_paths.paths == ref_paths.paths


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_split_same_plan(data: st.DataObject) -> None:
    n_dst = data.draw(st.sampled_from([1, 2, 4, 6, 8]))
    dst_items = data.draw(strategy_items(n_dst))
    unified = {
        "part0": SourceFile(
            "/u/part0.safetensors",
            0,
            {n: SourceTensor(DTYPES[n], s, math.prod(s) * DTYPES[n].itemsize) for n, s in PARAMS.items()},
        )
    }
    name_to_file = dict.fromkeys(PARAMS, "part0")
    dst = make_strategy(dst_items)
    ref = plan_split(unified, name_to_file, None, dst, "/dst", "ckpt")
    ref_loop = _plan_split_reference(
        _SplitJob(unified, name_to_file, None, dst, "/dst", "ckpt", list(range(n_dst)), {}, "net")
    )
    outputs = [OutputFile(f.path, f.format, f.metadata, f.rank) for f in ref.files]
    sources = [whole_chunks(n, s, DTYPES[n], "/u/part0.safetensors") for n, s in PARAMS.items()]
    targets = [Target(n, rank_boxes(dst_items[n], s)) for n, s in PARAMS.items()]
    box = plan_boxes(sources, outputs, targets, "split")
    validate_plan(box)
    assert box == ref
    assert box == ref_loop


# --------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_tensor() -> None:
    t = ChunkedTensor("w", (4,), dtypes.FLOAT32, (((0, 4),),), ("f",))
    outs = [OutputFile("/o/a.safetensors", "safetensors")]
    with pytest.raises(UsageError, match="no source tensor 'x'"):
        plan_boxes([t], outs, [Target("x", (((0, 4),),))])
    with pytest.raises(UsageError, match=r"output 0's box \[\[0, 5\]\] lies outside the tensor"):
        plan_boxes([t], outs, [Target("w", (((0, 5),),))])
    with pytest.raises(UsageError, match="2 boxes for 1 output files"):
        plan_boxes([t], outs, [Target("w", (((0, 4),), None))])
    with pytest.raises(UsageError, match="given twice"):
        plan_boxes([t, t], outs, [])
    holed = ChunkedTensor("w", (4,), dtypes.FLOAT32, (((0, 3),),), ("f",))
    with pytest.raises(LayoutError, match=r"'w'.*a hole"):
        plan_boxes([holed], outs, [Target("w", (((0, 1),),))])
    files = rank_files({"v": ParamLayout((2,), (0,))}, "/src")
    files[1].tensors["v"] = SourceTensor(dtypes.FLOAT16, (5,), 10)
    with pytest.raises(LayoutError, match=r"'v' has shape \[5\], but the strategy gives this rank a slice of \[12\]"):
        source_chunks("v", ParamLayout((2,), (0,)), (24,), files)


def test_absent_targets_and_orders() -> None:
    a = whole_chunks("a", (2, 2), dtypes.FLOAT32, "/s/a")
    b = whole_chunks("b", (3,), dtypes.INT8, "/s/b")
    outs = [OutputFile(f"/o/{i}", "safetensors") for i in range(2)]
    targets = [Target("a", (whole_box((2, 2)), None)), Target("b", (((0, 1),), ((1, 3),)), "bee")]
    plan = plan_boxes([a, b], outs, targets)
    assert [[t.name for t in f.tensors] for f in plan.files] == [["a", "bee"], ["bee"]]
    plan = plan_boxes([a, b], outs, targets, orders=[[1, 0], [1]])
    assert [[t.name for t in f.tensors] for f in plan.files] == [["bee", "a"], ["bee"]]
    assert plan.sources == ("/s/b", "/s/a")
    assert plan.summary()["bytes_written"] == 16 + 3
    validate_plan(plan)
    with pytest.raises(UsageError, match="has no box in it"):
        plan_boxes([a, b], outs, targets, orders=[[0, 1], [0]])
    with pytest.raises(UsageError, match="output 1 lists tensor 'a', which has no box in it"):
        plan_boxes([a, b], outs, targets, orders=[[0, 1], [0, 1]])  # one order for both outputs
    with pytest.raises(UsageError, match="holds tensor 'a' twice"):
        plan_boxes([a, b], outs[:1], [Target("a", (whole_box((2, 2)),)), Target("b", (((0, 3),),), "a")])


# --------------------------------------------------------------------------------------------
# uneven chunks, end to end


FULL = {
    "emb": np.arange(11 * 6, dtype=np.float32).reshape(11, 6),  # 11 rows in 4 torch.chunk shards: 3, 3, 3, 2
    "w": (np.arange(5 * 7, dtype=np.int32).reshape(5, 7) * 3),  # a 2 x 3 grid of uneven blocks
    "b": np.arange(7, dtype=np.float16),  # 7 in 3 shards: 3, 3, 1
    "s": np.array(4.5, dtype=np.float64),  # a scalar, whole in file 0
}
SRC_FILES = 3


def source_layout() -> dict[str, tuple[tuple, ...]]:
    return {
        "emb": even_boxes((11, 6), 0, 4),
        "w": grid_boxes((5, 7), [[2, 3], [1, 4, 2]]),
        "b": even_boxes((7,), 0, 3),
        "s": ((),),
    }


def write_uneven_sources(folder: Path) -> list[ChunkedTensor]:
    """Each tensor's chunks spread round-robin over three safetensors files, several per file."""
    contents: list[dict[str, np.ndarray]] = [{} for _ in range(SRC_FILES)]
    chunked = []
    for name, boxes in source_layout().items():
        files, tensors = [], []
        for k, box in enumerate(boxes):
            f = k % SRC_FILES
            key = f"{name}/chunk{k}"
            contents[f][key] = np.array(FULL[name][tuple(slice(a, b) for a, b in box)], order="C")
            files.append(str(folder / f"shard{f}.safetensors"))
            tensors.append(key)
        dtype = dtypes.from_numpy(FULL[name].dtype)
        chunked.append(ChunkedTensor(name, FULL[name].shape, dtype, boxes, tuple(files), tuple(tensors)))
    folder.mkdir(parents=True, exist_ok=True)
    for f, tensors in enumerate(contents):
        save_safetensors(folder / f"shard{f}.safetensors", tensors)
    return chunked


def run(plan: Plan, root: Path) -> None:
    validate_plan(plan)
    api.execute(plan, root=str(root), manifest=False)


def test_uneven_chunks_to_full_tensors(tmp_path: Path) -> None:
    chunked = write_uneven_sources(tmp_path / "src")
    out = OutputFile(str(tmp_path / "full" / "model.safetensors"), "safetensors")
    targets = [Target(t.name, (whole_box(t.shape),)) for t in chunked]
    plan = plan_boxes(chunked, [out], targets, "unify")
    assert isinstance(plan.files[0].tensors, BoxTensors)
    run(plan, tmp_path / "full")
    got = read_safetensors(out.path)
    assert sorted(got.entries) == sorted(FULL)
    for name, want in FULL.items():
        np.testing.assert_array_equal(got.array(name), want)


def test_uneven_chunks_to_another_uneven_chunking(tmp_path: Path) -> None:
    chunked = write_uneven_sources(tmp_path / "src")
    ranks = 3
    outputs = [OutputFile(str(tmp_path / "out" / f"rank_{r}.safetensors"), "safetensors") for r in range(ranks)]
    dst = {
        "emb": even_boxes((11, 6), 1, ranks),  # columns now: 2, 2, 2
        "w": even_boxes((5, 7), 0, ranks),  # rows 2, 2, 1
        "b": grid_boxes((7,), [[1, 5, 1]]),  # arbitrary sizes
        "s": ((), None, None),  # only in rank 0
    }
    targets = [Target(name, boxes) for name, boxes in dst.items()]
    plan = plan_boxes(chunked, outputs, targets, "reshard")
    run(plan, tmp_path / "out")
    for r, out in enumerate(outputs):
        got = read_safetensors(out.path)
        for name, boxes in dst.items():
            if boxes[r] is None:
                assert name not in got.entries
                continue
            want = FULL[name][tuple(slice(a, b) for a, b in boxes[r])]
            np.testing.assert_array_equal(got.array(name), want)


# --------------------------------------------------------------------------------------------
# a Checkpoint 2.0 (virtual rank files, pipeline stages, a save without redundant copies) as chunks


@pytest.mark.parametrize(
    ("params", "redundancy"),
    [(fx.dp2_tp4_params, False), (fx.dp2_tp4_params, True), (fx.pipeline_params, False)],
)
def test_checkpoint2_chunks_to_full_tensors(tmp_path: Path, params, redundancy: bool) -> None:
    root = tmp_path / "cp2"
    full = fx.write_checkpoint2(str(root), params(), 8, remove_redundancy=redundancy)
    opened = open_source(str(root))
    chunked = strategy_chunks(opened.ranks, opened.strategy)
    assert sorted(t.name for t in chunked) == sorted(full)
    out = OutputFile(str(tmp_path / "full" / "model.safetensors"), "safetensors")
    plan = plan_boxes(chunked, [out], [Target(t.name, (whole_box(t.shape),)) for t in chunked], "unify")
    run(plan, tmp_path / "full")
    got = read_safetensors(out.path)
    for name, want in full.items():
        np.testing.assert_array_equal(got.array(name), want, err_msg=name)


def test_validation_checks_chunks_against_the_opened_files() -> None:
    """Planning sees no file; the executor's validation compares each chunk read with its tensor."""
    t = ChunkedTensor("w", (6,), dtypes.FLOAT32, (((0, 4),), ((4, 6),)), ("/s/a", "/s/b"))
    plan = plan_boxes([t], [OutputFile("/o/w.safetensors", "safetensors")], [Target("w", (((0, 6),),))])
    shapes = {("/s/a", "w"): (4,), ("/s/b", "w"): (2,)}
    validate_plan(plan, lambda i, name: shapes.get((plan.sources[i], name)))
    shapes[("/s/b", "w")] = (3,)
    with pytest.raises(PlanError, match=r"reads 'w' of /s/b as a chunk of shape \[2\], but it has shape \(3,\)"):
        validate_plan(plan, lambda i, name: shapes.get((plan.sources[i], name)))
