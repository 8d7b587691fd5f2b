"""A DCP output's ``.metadata`` as columns (``plan.dcp_chunks``) is the one the per-chunk records give.

``reference`` is the computation ``ops.chunked.boxed_dcp`` made before: each tensor's placements, one
``ChunkPlace`` per chunk gathered per data file, then ``plan.dcp.chunks_metadata`` (a ``dcp.Chunk`` and
an ``archive_size`` per chunk). The fast path must give the same records and the same pickle bytes
on random tensors (shapes, dtypes, row grains, empty and 0-dim ones) and chunkings (``EvenRows``),
and through the whole plan with a destination strategy (``StrategyBoxes``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import api, dtypes
from reshard.formats import dcp
from reshard.layout.chunks import whole_box
from reshard.ops import chunked
from reshard.plan.boxes import BoxTensors
from reshard.plan.dcp import EvenRows, chunks_metadata, data_file_name, placements
from reshard.plan.dcp_chunks import Placements, metadata_columns
from reshard.plan.model import TensorPlan
from tests.test_dcp_plan_scale import _data, job  # noqa: F401  (the module's fixture)

FOLDER = "/out"
DTYPES = [dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.INT8, dtypes.FLOAT64, dtypes.BOOL]


def _tensor(name: str, dtype: dtypes.DType, shape: tuple[int, ...]) -> TensorPlan:
    return TensorPlan(name, dtype, shape, (), 0)


def reference(tensors: list[TensorPlan], how: EvenRows) -> bytes:
    """The ``.metadata`` the per-chunk records give (boxed_dcp before ``plan.dcp_chunks``)."""
    placed = [(t, placements(t, how, ()) or [(0, whole_box(t.shape))]) for t in tensors]
    ranks = sorted({r for _, where in placed for r, _ in where})
    column = {r: j for j, r in enumerate(ranks)}
    per_file: list[list[tuple]] = [[] for _ in ranks]
    for t, where in placed:
        for r, box in where:
            per_file[column[r]].append((t.name, t.dtype, tuple(a for a, _ in box), tuple(b - a for a, b in box)))
    paths = [os.path.join(FOLDER, data_file_name(r)) for r in ranks]
    shapes = {t.name: (t.dtype, t.shape) for t in tensors}
    return chunks_metadata(zip(paths, per_file, strict=True), FOLDER, shapes).text


def columns(tensors: list[TensorPlan], how: EvenRows) -> bytes:
    chunkings = Placements(how)
    placed = [(t.name, t.dtype, t.shape, chunkings.of(t)) for t in tensors]
    ranks = chunkings.ranks()
    return metadata_columns(placed, ranks, FOLDER).text  # type: ignore[arg-type]


shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 40)),
    st.tuples(st.integers(0, 40), st.integers(1, 5)),
    st.tuples(st.integers(1, 12), st.integers(1, 4), st.integers(1, 3)),
)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES), st.integers(1, 4)), min_size=1, max_size=8),
    parts=st.integers(1, 9),
)
def test_the_columns_are_the_per_chunk_records(specs, parts: int) -> None:
    tensors = [_tensor(f"t{k}", dtype, shape) for k, (shape, dtype, _) in enumerate(specs)]
    grains = {f"t{k}": grain for k, (_, _, grain) in enumerate(specs) if grain > 1}
    how = EvenRows(parts, grains)
    assert columns(tensors, how) == reference(tensors, how)


def test_tensors_cut_alike_share_their_columns() -> None:
    """One chunking of one shape is one ``Placed``: its boxes, offsets and sizes made once."""
    how = EvenRows(4)
    chunkings = Placements(how)
    a, b = chunkings.of(_tensor("a", dtypes.FLOAT32, (8, 3))), chunkings.of(_tensor("b", dtypes.BFLOAT16, (8, 3)))
    assert a is b and a is not None
    assert chunkings.of(_tensor("c", dtypes.FLOAT32, (9, 3))) is not a
    chunkings.ranks()
    assert a.archive_lengths(dtypes.FLOAT32) is a.archive_lengths(dtypes.FLOAT32)
    assert a.archive_lengths(dtypes.FLOAT32).tolist() == [dcp.archive_size(dtypes.FLOAT32, (2, 3))] * 4


def test_the_tiling_is_checked_once_per_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiling check runs once per chunking, not once per tensor cut alike."""
    calls = []
    real = dcp.check_chunks
    monkeypatch.setattr(dcp, "check_chunks", lambda t, *a: (calls.append(t.fqn), real(t, *a)))
    tensors = [_tensor(f"t{k}", dtypes.FLOAT32, (10, 2)) for k in range(5)] + [_tensor("u", dtypes.FLOAT32, (3,))]
    fast = columns(tensors, EvenRows(3))
    assert calls == ["t0", "u"]
    assert fast == reference(tensors, EvenRows(3))


def test_a_destination_strategy_plans_as_the_general_path(job, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    """``StrategyBoxes`` (a MindSpore strategy's rank boxes, pipeline stages included): the box plan writes the
    bytes the general re-cut writes."""
    strategy = os.path.join(os.path.dirname(os.path.dirname(job["full"])), "merged", "s4.ckpt")
    out = api.OutputSpec(format="dcp")
    boxed, general = str(tmp_path / "boxed"), str(tmp_path / "general")
    report = api.transform(job["dcp"], boxed, None, strategy, output=out)
    assert all(isinstance(f.tensors, BoxTensors) for f in report.plan.files)
    with monkeypatch.context() as patched:
        patched.setattr(chunked, "boxed_dcp", lambda *args: None)
        again = api.transform(job["dcp"], general, None, strategy, output=out)
        assert not any(isinstance(f.tensors, BoxTensors) for f in again.plan.files)
    assert report.plan.summary() == again.plan.summary()
    assert _data(boxed) == _data(general)
