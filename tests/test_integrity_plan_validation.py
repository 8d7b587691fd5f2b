"""Every plan is validated before a byte is written: copies inside their source and destination
bounds, each destination tensor covered exactly once. A violation is an internal error naming
the tensor (``PlanError``, not a ``ReshardError``), never silent zeros in a preallocated file."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest

from reshard import api, dtypes
from reshard.errors import ReshardError
from reshard.plan import Copy, FilePlan, Plan, RankTensors, TensorPlan
from reshard.plan.validate import PlanError, validate_plan
from tests.trust_helpers import make_job

F32 = dtypes.FLOAT32
SHAPE = (4, 6)


def _tensor(*copies: Copy, name: str = "w", shape: tuple[int, ...] = SHAPE) -> TensorPlan:
    return TensorPlan(name, F32, shape, tuple(copies), 4 * shape[0] * shape[1])


def _rows(r0: int, r1: int, src_row: int = 0, source: int = 0) -> Copy:
    """Rows r0..r1 of the destination from rows src_row.. of source tensor 'w'."""
    return Copy(source, "w", (src_row, 0), (r0, 0), (r1 - r0, SHAPE[1]))


def _plan(*tensors: TensorPlan, path: str = "/out/a.ckpt", sources: int = 2) -> Plan:
    return Plan("test", tuple(f"/src/{i}.ckpt" for i in range(sources)), (FilePlan(path, "ckpt", tuple(tensors)),))


def _shapes(i: int, name: str) -> tuple[int, ...] | None:
    return (2, 6) if name == "w" else None  # each source holds a 2 x 6 slice


def test_a_correct_plan_passes() -> None:
    validate_plan(_plan(_tensor(_rows(0, 2), _rows(2, 4, source=1))), _shapes)


@pytest.mark.parametrize(
    ("copies", "message"),
    [
        ((_rows(0, 2),), "fill 12 of its 24 elements \\(they leave a gap\\)"),
        ((_rows(0, 2), _rows(1, 3, source=1), _rows(3, 4)), "copies overlap at \\[0:2, 0:6\\] and \\[1:3, 0:6\\]"),
        ((_rows(0, 2), _rows(2, 4), _rows(2, 4, source=1)), "copies overlap"),
        ((_rows(0, 2), _rows(3, 5, source=1)), "copy 1 writes \\[3:5, 0:6\\], outside the tensor's shape \\[4, 6\\]"),
        ((_rows(0, 2), _rows(2, 4, src_row=1, source=1)), "copy 1 reads \\[1:3, 0:6\\], outside its source tensor's"),
        ((_rows(0, 2), _rows(2, 4, source=5)), "copy 1 reads source 5 of 2"),
        ((_rows(0, 2), Copy(1, "w", (0,), (2,), (2,))), "copy 1 has 1 dimensions, the tensor 2"),
        ((_rows(0, 2), Copy(1, "nope", (0, 0), (2, 0), (2, 6))), "reads 'nope', which its source file does not hold"),
    ],
)
def test_bad_plans_are_internal_errors_naming_the_tensor(copies: tuple[Copy, ...], message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        validate_plan(_plan(_tensor(*copies, name="model.w")), _shapes)
    assert "/out/a.ckpt: tensor 'model.w'" in str(info.value)
    assert not isinstance(info.value, ReshardError)


def test_source_bounds_are_skipped_without_source_shapes() -> None:
    validate_plan(_plan(_tensor(_rows(0, 2, src_row=7), _rows(2, 4, source=1))))


def test_duplicate_outputs_and_tensors() -> None:
    good = _tensor(_rows(0, 2), _rows(2, 4, source=1))
    with pytest.raises(PlanError, match="'w' is planned twice"):
        validate_plan(_plan(good, good))
    twice = Plan("test", ("/src/0.ckpt", "/src/1.ckpt"), (FilePlan("/o/a", "ckpt", (good,)),) * 2)
    with pytest.raises(PlanError, match="/o/a: planned as two outputs"):
        validate_plan(twice)


def test_literal_and_empty_and_scalar_tensors() -> None:
    literal = TensorPlan("s", dtypes.STR, (0,), (), 8, b"a\0\0\0b\0\0\0")
    empty = TensorPlan("e", F32, (0, 3), (Copy(0, "e", (0, 0), (0, 0), (0, 3)),), 0)
    scalar = TensorPlan("x", F32, (), (Copy(0, "x", (), (), ()),), 4)
    validate_plan(_plan(literal, empty, scalar))
    with pytest.raises(PlanError, match="'x': the copies fill 2 of its 1 elements"):
        validate_plan(_plan(dataclasses.replace(scalar, copies=scalar.copies * 2)))
    with pytest.raises(PlanError, match="given literally"):
        validate_plan(_plan(dataclasses.replace(literal, nbytes=4)))


# ------------------------------------------------------------------------------------ real plans


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("val")))


def _bulk_plan(job: dict[str, str], dst: str) -> Plan:
    plan = api.transform(job["r8"], dst, job["s8"], job["s4"], destination=api.Destination(dry_run=True)).plan
    assert isinstance(plan.files[0].tensors, RankTensors)
    return plan


def test_every_planner_passes(job: dict[str, str], tmp_path) -> None:
    plans = [
        _bulk_plan(job, str(tmp_path / "t")),
        api.transform(job["r8"], str(tmp_path / "f"), job["s8"], None, destination=api.Destination(dry_run=True)).plan,
        api.transform(
            job["full"], str(tmp_path / "s"), None, job["s8"], destination=api.Destination(dry_run=True)
        ).plan,
        api.unify(job["r8st"], job["s8"], str(tmp_path / "u"), destination=api.Destination(dry_run=True)).plan,
        api.convert(job["r8"], str(tmp_path / "c"), "safetensors", destination=api.Destination(dry_run=True)).plan,
    ]
    for plan in plans:
        validate_plan(plan)


def _broken_bulk(plan: Plan) -> RankTensors:
    """Drop the last copy of the first layout class with several copies, in the first output."""
    tensors = plan.files[0].tensors
    assert isinstance(tensors, RankTensors)
    index = next(i for i, share in enumerate(tensors.shares) if len(share.copies) > 1)
    share = tensors.shares[index]
    broken = dataclasses.replace(share, copies=share.copies[:-1])
    tensors.shares = (*tensors.shares[:index], broken, *tensors.shares[index + 1 :])
    return tensors


def test_a_broken_bulk_table_is_caught_and_nothing_is_written(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    plan = api.transform(
        job["r8"], dst, job["s8"], None, destination=api.Destination(dry_run=True)
    ).plan  # merge: several copies per tensor
    _broken_bulk(plan)
    with pytest.raises(PlanError, match="leave a gap"):
        validate_plan(plan)
    with pytest.raises(PlanError, match=r"rank_0/checkpoint_0\.ckpt: tensor '[^']+' \(and every tensor"):
        api.execute(plan, root=dst)
    assert not os.path.exists(dst)


def test_a_bad_plain_plan_is_refused_by_the_executor_before_writing(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    plan = api.convert(job["full"], dst, "safetensors", destination=api.Destination(dry_run=True)).plan
    (f,) = plan.files
    t = f.tensors[0]
    bad = dataclasses.replace(t, copies=(dataclasses.replace(t.copies[0], src_start=(1,) * len(t.shape)),))
    plan = dataclasses.replace(plan, files=(dataclasses.replace(f, tensors=(bad, *f.tensors[1:])),))
    with pytest.raises(PlanError, match=f"tensor {t.name!r}: copy 0 reads"):
        api.execute(plan, root=dst)
    assert not os.path.exists(dst)


def test_validating_the_bench_plan_is_fast() -> None:
    """1 000 parameters x 1 024 ranks (bench/plan_bench.py's job) in well under a second."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
    try:
        import plan_bench
    finally:
        sys.path.pop(0)
    from reshard.plan import plan_transform

    sources, src, dst = plan_bench.build(1000, 1024, 1)
    plan = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt")
    start = time.perf_counter()
    validate_plan(plan)
    assert time.perf_counter() - start < 0.5
