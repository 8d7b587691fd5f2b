"""Model maps composed onto plans (reshard.plan.surgery) against materialise-then-numpy.

Inputs are full tensors assembled from random grid boxes of source tensors (each source a slice
of its tensor, sometimes with a margin, as rank files are); the map's outputs are composed onto
those copies (through stack and unstack views) and assembled by the executors' one assembly
function, ``assemble.full_tensor``. The reference materialises every input first and applies
``np.stack`` / ``np.take`` / split / concatenate. The map-before-planning path (a virtual source
resolved back to real files) is checked the same way.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.execute.assemble import full_tensor
from reshard.naming import Join, ModelMap, Split, Stack, Transpose, Unstack
from reshard.plan import validate_plan
from reshard.plan.model import Copy, FilePlan, Plan, SourceFile, SourceTensor, TensorPlan
from reshard.plan.surgery import MappedModel, compose_after

F32 = dtypes.from_ms_name("Float32")

Shape = tuple[int, ...]


@st.composite
def grids(draw: st.DrawFn, shape: Shape) -> list[tuple[Shape, Shape]]:
    """A partition of ``shape`` into boxes (start, lengths) by random cuts per dimension."""
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=2)) if n > 1 else set()
        points = [0, *sorted(inner), n]
        cuts.append([(a, b - a) for a, b in itertools.pairwise(points)])
    boxes: list[tuple[Shape, Shape]] = [((), ())]
    for dim in cuts:
        boxes = [((*s, a), (*n, m)) for s, n in boxes for a, m in dim]
    return boxes


class World:
    """Source arrays by (source index, name) and the plan tensors assembled from them."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.arrays: dict[tuple[int, str], np.ndarray] = {}
        self.rng = np.random.default_rng(0)

    def tensor(self, draw: st.DrawFn, name: str, shape: Shape) -> TensorPlan:
        copies = []
        for start, lengths in draw(grids(shape)):
            margin = tuple(draw(st.integers(0, 1)) for _ in shape)
            held = tuple(n + m for n, m in zip(lengths, margin, strict=True))
            source = len(self.paths)
            self.paths.append(f"rank_{source}")
            self.arrays[(source, name)] = self.rng.standard_normal(held).astype(np.float32)
            copies.append(Copy(source, name, margin, start, lengths, whole_source=not any(margin)))
        return TensorPlan(name, F32, shape, tuple(copies), math.prod(shape) * 4)

    def source_array(self, source: int, name: str) -> np.ndarray:
        return self.arrays[(source, name)]

    def shape(self, source: int, name: str) -> Shape:
        return self.arrays[(source, name)].shape


def materialise(world: World, plan: Plan) -> dict[str, np.ndarray]:
    validate_plan(plan, world.shape)
    return {t.name: full_tensor(t, world.source_array) for f in plan.files for t in f.tensors}


@st.composite
def stacked_case(draw: st.DrawFn) -> tuple[World, Plan, int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    experts = draw(st.integers(1, 3))
    axis = draw(st.integers(0, len(shape)))
    world = World()
    tensors = tuple(world.tensor(draw, f"e.{e}.w", shape) for e in range(experts))
    return world, Plan("t", (), (FilePlan("out", "safetensors", tensors),)), experts, axis


@settings(max_examples=120, deadline=None)
@given(stacked_case())
def test_stack_composed_on_boxes(case: tuple[World, Plan, int, int]) -> None:
    world, plan, experts, axis = case
    world_plan = Plan(plan.operation, tuple(world.paths), plan.files)
    inputs = materialise(world, world_plan)
    stacked, report = compose_after(world_plan, ModelMap((Stack(r"e\.(?P<expert>\d+)\.w", "s", axis),)), world.shape)
    got = materialise(world, stacked)
    np.testing.assert_array_equal(got["s"], np.stack([inputs[f"e.{e}.w"] for e in range(experts)], axis))
    assert report.surgery[0][0] == "stack"


@settings(max_examples=120, deadline=None)
@given(stacked_case(), st.data())
def test_permuted_folded_stack_composed_on_boxes(case: tuple[World, Plan, int, int], data: st.DataObject) -> None:
    world, plan, experts, _ = case
    world_plan = Plan(plan.operation, tuple(world.paths), plan.files)
    inputs = materialise(world, world_plan)
    ndim = inputs["e.0.w"].ndim
    perm = tuple(data.draw(st.permutations(range(ndim))))
    fold = data.draw(st.booleans())
    axis = data.draw(st.integers(0, ndim - 1 if fold else ndim))
    stack = ModelMap((Stack(r"e\.(?P<expert>\d+)\.w", "s", axis, perm, fold), Transpose("x", "y", (0,))))
    got = materialise(world, compose_after(world_plan, stack, world.shape)[0])["s"]
    parts = [inputs[f"e.{e}.w"].transpose(perm) for e in range(experts)]
    np.testing.assert_array_equal(got, np.concatenate(parts, axis) if fold else np.stack(parts, axis))


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_folded_unstack_with_transpose_composed_on_boxes(data: st.DataObject) -> None:
    """MindFormers' ``weight1`` (experts' fc1 transposed, concatenated) back to per-expert tensors."""
    experts, rows, cols = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    world = World()
    tensor = world.tensor(data.draw, "w1", (experts * rows, cols))
    plan = Plan("t", tuple(world.paths), (FilePlan("out", "safetensors", (tensor,)),))
    stacked = materialise(world, plan)["w1"]
    unstack = ModelMap((Unstack("w1", "e.{expert}.fc1", 0, (1, 0), "n"),), {"n": experts})
    got = materialise(world, compose_after(plan, unstack, world.shape)[0])
    for e in range(experts):
        np.testing.assert_array_equal(got[f"e.{e}.fc1"], stacked[e * rows : (e + 1) * rows].T)


@st.composite
def unstack_case(draw: st.DrawFn) -> tuple[World, Plan, int]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=4)))
    axis = draw(st.integers(0, len(shape) - 2))
    world = World()
    plan = Plan("t", (), (FilePlan("out", "safetensors", (world.tensor(draw, "s", shape),)),))
    return world, Plan(plan.operation, tuple(world.paths), plan.files), axis


@settings(max_examples=120, deadline=None)
@given(unstack_case())
def test_unstack_composed_on_boxes(case: tuple[World, Plan, int]) -> None:
    world, plan, axis = case
    stacked = materialise(world, plan)["s"]
    out, _ = compose_after(plan, ModelMap((Unstack("s", "e.{expert}.w", axis),)), world.shape)
    got = materialise(world, out)
    assert len(got) == stacked.shape[axis]
    for e in range(stacked.shape[axis]):
        np.testing.assert_array_equal(got[f"e.{e}.w"], np.take(stacked, e, axis=axis))


@st.composite
def split_case(draw: st.DrawFn) -> tuple[World, Plan, int, list[int], int]:
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(0, ndim - 1))
    groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 2)) * groups for _ in range(draw(st.integers(1, 3)))]
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[axis] = sum(sizes)
    world = World()
    plan = Plan("t", (), (FilePlan("out", "safetensors", (world.tensor(draw, "f", tuple(shape)),)),))
    return world, Plan(plan.operation, tuple(world.paths), plan.files), axis, sizes, groups


@settings(max_examples=120, deadline=None)
@given(split_case())
def test_split_then_join_composed_on_boxes(case: tuple[World, Plan, int, list[int], int]) -> None:
    world, plan, axis, sizes, groups = case
    fused = materialise(world, plan)["f"]
    parts = tuple(f"p{k}" for k in range(len(sizes)))
    split, _ = compose_after(plan, ModelMap((Split("f", parts, axis, tuple(sizes), groups),)), world.shape)
    got = materialise(world, split)
    moved = np.moveaxis(fused, axis, 0).reshape(groups, -1, *np.moveaxis(fused, axis, 0).shape[1:])
    cuts = np.cumsum([s // groups for s in sizes])[:-1]
    for name, want in zip(parts, np.split(moved, cuts, axis=1), strict=True):
        np.testing.assert_array_equal(got[name], np.moveaxis(want.reshape(-1, *want.shape[2:]), 0, axis))
    joined, _ = compose_after(split, ModelMap((Join(parts, "f", axis, groups),)), world.shape)
    np.testing.assert_array_equal(materialise(world, joined)["f"], fused)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 3), st.data())
def test_map_before_planning_resolves_to_real_files(shape: list[int], experts: int, data: st.DataObject) -> None:
    """A virtual source of stacked tensors, planned as row blocks (as a destination strategy would), read back."""
    rng = np.random.default_rng(1)
    arrays = {f"e.{e}.w": rng.standard_normal(shape).astype(np.float32) for e in range(experts)}
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    fold = data.draw(st.booleans())
    axis = data.draw(st.integers(0, len(shape) - 1 if fold else len(shape)))
    real = SourceFile("real.safetensors", 0, {n: SourceTensor(F32, a.shape, a.nbytes) for n, a in arrays.items()})
    model = MappedModel(
        {real.path: real},
        {n: real.path for n in arrays},
        ModelMap((Stack(r"e\.(?P<expert>\d+)\.w", "s", axis, perm, fold),)),
    )
    virtual = model.source.tensors["s"]
    rows = data.draw(st.integers(1, virtual.shape[0]))
    copies = tuple(
        Copy(0, "s", (r0, *(0,) * (len(virtual.shape) - 1)), (0, *(0,) * (len(virtual.shape) - 1)),
             (min(rows, virtual.shape[0] - r0), *virtual.shape[1:]))
        for r0 in range(0, virtual.shape[0], rows)
    )  # fmt: skip
    files = tuple(
        FilePlan(f"rank_{k}", "safetensors", (TensorPlan("s", F32, c.lengths, (c,), math.prod(c.lengths) * 4),))
        for k, c in enumerate(copies)
    )
    resolved = model.resolve(Plan("t", (model.source.path,), files))
    assert resolved.sources == (real.path,)
    parts = [arrays[f"e.{e}.w"].transpose(perm) for e in range(experts)]
    want = np.concatenate(parts, axis) if fold else np.stack(parts, axis)
    for k, f in enumerate(resolved.files):
        (t,) = f.tensors
        got = full_tensor(t, lambda source, name: arrays[name])
        r0 = k * rows
        np.testing.assert_array_equal(got, want[r0 : r0 + t.shape[0]])


def test_ray_nodes_byte_runs_read_through_the_view() -> None:
    """Without a shared disk, the bytes a node fetches for a copy are those of the box in the view."""
    from reshard.execute.nodes import TensorFacts, file_runs

    facts = TensorFacts((4, 3, 5), F32, 4, ((1000, 4 * 3 * 5 * 4),))  # one segment at file offset 1000
    copy = Copy(0, "s", (3, 0), (0, 0), (3, 5), src_view=(12, 5))  # expert 1 of an unstack: rows 3..5 of the view
    assert file_runs(facts, copy) == [(1000 + 3 * 5 * 4, 3 * 5 * 4)]
