"""``plan_transform``'s and ``plan_split``'s bulk paths against their reference loops.

The bulk path builds plans from per-class tables and lazy ``RankTensors``; the reference path is
the plain per-parameter loop (``TransformPlanner.plan_rank``, ``_plan_split_reference``). On
random strategies (pipeline stages, shared parameters, optimizer shards, list maps, device counts
that do not divide, parameters dropped from some ranks as ``remove_redundancy`` does, wrong slice
shapes) both must give the same plan, or the same error. Everything is in memory: no files.
"""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import dtypes, layout
from reshard.errors import ReshardError
from reshard.formats import rank_dirs
from reshard.formats.strategy import StrategyFile, make_strategy
from reshard.layout import ParamLayout, StagedLayout, device_num, stage_count
from reshard.plan import (
    MATERIALISED_FILES,
    FilePlan,
    FileStats,
    Plan,
    RankTensors,
    SourceFile,
    SourceTensor,
    TransformPlanner,
    plan_split,
    plan_transform,
)
from reshard.plan.model import Role, SourcePaths, output_metadata
from reshard.plan.split import _plan_split_reference, _SplitJob
from reshard.plan.transform_reference import StageCut, stage_cut

DEVS = {2: [(2,), (1, 2)], 4: [(4,), (2, 2)], 6: [(2, 3), (3, 2)], 8: [(2, 2, 2), (4, 2), (2, 4)]}
PARAMS = {"emb": (24, 12), "w": (12, 24), "v": (24,), "s": ()}  # "emb" is shared by first and last stage
DTYPES = {"emb": dtypes.FLOAT32, "w": dtypes.BFLOAT16, "v": dtypes.FLOAT16, "s": dtypes.INT32}
EXTRA = "global_step"  # in every file, in no strategy: copied whole


@st.composite
def layouts(draw: st.DrawFn, devices: int, shape: tuple[int, ...]) -> ParamLayout:
    """A random layout over ``devices`` that divides ``shape`` (flat or list map, maybe an opt shard)."""
    for _ in range(20):
        dev = draw(st.sampled_from(DEVS[devices]))
        axes = list(range(len(dev)))
        draw(st.randoms()).shuffle(axes)
        tmap: list[object] = []
        for _ in shape:
            k = draw(st.integers(0, min(2, len(axes))))
            values, axes = tuple(axes[:k]), axes[k:]
            tmap.append(-1 if not values else values[0] if len(values) == 1 else values)
        step, size = 0, 0
        if draw(st.booleans()):
            step, size = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([2, -1]))
        p = ParamLayout(dev, tuple(tmap), step, size)  # type: ignore[arg-type]
        try:
            layout.slice_shape(p, shape)
            layout.rank_boxes(p, shape)
        except ReshardError:
            continue
        return p
    return ParamLayout(DEVS[devices][0], (-1,) * len(shape))


def _stages(name: str, pp: int) -> list[int]:
    if name == "emb":
        return sorted({0, pp - 1})
    return [list(PARAMS).index(name) % pp]


@st.composite
def strategies(draw: st.DrawFn, devices: int, pp: int) -> StrategyFile:
    items: dict[str, ParamLayout] = {}
    for name, shape in PARAMS.items():
        for stage in _stages(name, pp):
            key = f"{stage}-{name}" if pp > 1 else name
            items[key] = draw(layouts(devices, shape))
    return make_strategy(items)


def _sources(
    src: StrategyFile | None, devices: int, pp: int, drops: set[tuple[int, str]], wrong: tuple[int, str] | None
) -> dict[int, SourceFile]:
    """Every rank's file: the slices its stage holds (minus ``drops``), plus ``EXTRA``."""
    out: dict[int, SourceFile] = {}
    for rank in range(devices * pp):
        stage = rank // devices
        tensors: dict[str, SourceTensor] = {}
        for name, full in PARAMS.items():
            if src is not None and stage not in _stages(name, pp):
                continue
            if (rank, name) in drops:
                continue
            key = f"{stage}-{name}" if pp > 1 else name
            shape = layout.slice_shape(src.layouts[key], full) if src is not None else full
            if (rank, name) == wrong:
                shape = (*shape[:-1], shape[-1] + 1) if shape else (2,)
            dt = DTYPES[name]
            tensors[name] = SourceTensor(dt, shape, math.prod(shape) * dt.itemsize)
        tensors[EXTRA] = SourceTensor(dtypes.INT64, (1,), 8)
        out[rank] = SourceFile(f"/in/rank_{rank}/checkpoint_{rank}.ckpt", rank, tensors)
    return out


def _reference(sources: dict[int, SourceFile], src: StrategyFile | None, dst: StrategyFile | None) -> Plan:
    """``plan_transform`` as it was: ``plan_rank`` per rank, sources interned tensor by tensor."""
    planner = TransformPlanner(sources, src, dst)
    planner.check_rank_count()
    planner.check_agreement()  # the files and the strategy agree, before any plan (reshard.plan.agree)
    interned = SourcePaths()
    files = []
    for rank in range(planner.dst_total):
        path = rank_dirs.rank_output("/out", rank, "checkpoint_", "ckpt")
        files.append(FilePlan(path, "ckpt", planner.plan_rank(rank, interned), output_metadata("ckpt"), rank))
    return Plan("transform", tuple(interned.paths), tuple(files))


def _outcome(make: object) -> Plan | str:
    try:
        return make()  # type: ignore[operator]
    except ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"


def _assert_same(sources: dict[int, SourceFile], src: StrategyFile | None, dst: StrategyFile | None) -> None:
    fast = _outcome(lambda: plan_transform(sources, src, dst, "/out", "checkpoint_", "ckpt"))
    ref = _outcome(lambda: _reference(sources, src, dst))
    if isinstance(ref, str) or isinstance(fast, str):
        assert fast == ref
        return
    assert fast.sources == ref.sources
    assert len(fast.files) == len(ref.files)
    for a, b in zip(fast.files, ref.files, strict=True):
        assert isinstance(a.tensors, RankTensors)
        assert (a.path, a.rank, a.metadata) == (b.path, b.rank, b.metadata)
        assert tuple(a.tensors) == b.tensors
        assert a.stats == FileStats.of(tuple(a.tensors))
    assert fast.summary() == ref.summary()
    assert fast.to_json() == ref.to_json()


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_random_strategies_match_the_reference(data: st.DataObject) -> None:
    n_src, n_dst = data.draw(st.sampled_from([(2, 4), (4, 2), (4, 8), (8, 4), (4, 6), (6, 4), (8, 8), (2, 6)]))
    pp_src, pp_dst = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 2]))
    src, dst = data.draw(strategies(n_src, pp_src)), data.draw(strategies(n_dst, pp_dst))
    _assert_same(_sources(src, n_src, pp_src, set(), None), src, dst)


@SETTINGS
@given(data=st.data())
def test_missing_and_wrong_slices_fail_the_same_way(data: st.DataObject) -> None:
    """Dropped slices (found in another copy, or reported) and wrong shapes: same plan or same error."""
    n_src, n_dst = data.draw(st.sampled_from([(2, 4), (4, 2), (8, 4), (4, 6)]))
    pp = data.draw(st.sampled_from([1, 2]))
    src, dst = data.draw(strategies(n_src, pp)), data.draw(strategies(n_dst, 1))
    ranks = st.integers(0, n_src * pp - 1)
    names = st.sampled_from([*PARAMS, EXTRA])
    drops = set(data.draw(st.lists(st.tuples(ranks, names), max_size=3)))
    wrong = data.draw(st.none() | st.tuples(ranks, names))
    _assert_same(_sources(src, n_src, pp, drops, wrong), src, dst)


@pytest.mark.parametrize(("with_src", "with_dst"), [(False, True), (True, False)], ids=["full->N", "N->full"])
def test_full_source_or_destination(with_src: bool, with_dst: bool) -> None:
    strategy = make_strategy(
        {
            "emb": ParamLayout((2, 2), (1, 0)),
            "w": ParamLayout((2, 2), (0, -1), 2, 2),
            "v": ParamLayout((2, 2), (0,)),
            "s": ParamLayout((2, 2), ()),
        }
    )
    src = strategy if with_src else None
    _assert_same(_sources(src, 4 if with_src else 1, 1, set(), None), src, strategy if with_dst else None)


def _plan(ranks: int = 12) -> Plan:
    src = make_strategy({"w": ParamLayout((2, 2), (1, 0)), "v": ParamLayout((2, 2), (0,))})
    dst = make_strategy({"w": ParamLayout((ranks // 2, 2), (0, -1)), "v": ParamLayout((ranks // 2, 2), (-1,))})
    sources = {
        r: SourceFile(
            f"/in/{r}.ckpt",
            r,
            {"w": SourceTensor(dtypes.FLOAT32, (12, 6), 288), "v": SourceTensor(dtypes.FLOAT32, (12,), 48)},
        )
        for r in range(4)
    }
    return plan_transform(sources, src, dst, "/out", "checkpoint_", "ckpt")


def test_rank_tensors_behave_like_a_tuple() -> None:
    plan = _plan()
    tensors = plan.files[3].tensors
    assert isinstance(tensors, RankTensors)
    built = tuple(tensors)
    assert len(tensors) == len(built) == 2
    assert tensors[0] == built[0] and tensors[-1] == built[-1] and tensors[:1] == built[:1]
    assert tensors == built and hash(tensors) == hash(built)
    assert [t.name for t in tensors] == ["w", "v"] and built[1] in tensors
    assert pickle.loads(pickle.dumps(tensors)) == built  # ships as a plain tuple (Ray)
    assert type(pickle.loads(pickle.dumps(plan.files[3])).tensors) is tuple
    assert plan.files[3].copy_count == sum(len(t.copies) for t in built)
    assert plan.files[3].nbytes == sum(t.nbytes for t in built)


def test_built_files_are_cached_but_bounded() -> None:
    plan = _plan(ranks=4 * MATERIALISED_FILES)
    first = plan.files[0].tensors
    assert isinstance(first, RankTensors)
    assert first.materialise() is first.materialise()  # iterating a file twice builds it once
    for f in plan.files[1:]:
        tuple(f.tensors)
    assert len(first.built) <= MATERIALISED_FILES and all(f.tensors.built is first.built for f in plan.files)
    assert first.materialise() == tuple(first)  # evicted, rebuilt equal


def test_each_planning_run_owns_its_built_files() -> None:
    """The LRU of built tensors belongs to a planning run: one plan's files never evict another's."""
    a, b = _plan(), _plan()
    assert a.files[0].tensors.built is not b.files[0].tensors.built
    built = a.files[0].tensors.materialise()
    for f in b.files:
        tuple(f.tensors)
    assert a.files[0].tensors.materialise() is built


def _old_decision(cut: StageCut, name: str) -> Role:
    """What plan.py decided before ``StageCut.role``: ``keeps`` and ``transforms``, as they were."""
    src, dst, dropped = cut.src, cut.dst, cut.dropped
    if src is None and dst is None:
        return Role.TRANSFORM
    not_local_src = src is None or (name in src and name in dropped)
    not_local_dst = dst is None or name in dropped
    if not_local_src and not_local_dst:
        return Role.SKIP
    in_src = src is None or (name in src and name not in dropped)
    in_dst = dst is None or (name in dst and name not in dropped)
    return Role.TRANSFORM if in_src and in_dst else Role.WHOLE


def test_the_one_decision_is_the_old_one() -> None:
    """``StageCut.role`` over every combination of: in the source map, in the destination map (and
    in which stages), the stage planned."""
    staged = {
        "0": StagedLayout(ParamLayout((2,), (0,)), (0,)),
        "1": StagedLayout(ParamLayout((2,), (0,)), (1,)),
        "01": StagedLayout(ParamLayout((2,), (0,)), (0, 1)),
    }
    names = ["a", "b", "c", "d"]
    seen = set()
    for src_names in [None, *itertools.chain.from_iterable(itertools.combinations(names, k) for k in range(5))]:
        src = None if src_names is None else {n: staged["01"] for n in src_names}
        for dst_stages in [None, *itertools.product([None, "0", "1", "01"], repeat=len(names))]:
            dst = None if dst_stages is None else {n: staged[k] for n, k in zip(names, dst_stages, strict=True) if k}
            for stage in (0, 1):
                cut = stage_cut(src, dst, stage)
                for name in [*names, "e"]:
                    assert cut.role(name) is _old_decision(cut, name), (src, dst, stage, name)
                    seen.add(cut.role(name))
    assert seen == set(Role)


def _unified(names: dict[str, tuple[int, ...]], rename: dict[str, str]) -> tuple[dict[str, SourceFile], dict[str, str]]:
    """Two part files holding the full tensors (under renamed keys), and the name -> part index."""
    parts: dict[str, SourceFile] = {}
    name_to_file: dict[str, str] = {}
    for i, (name, shape) in enumerate(names.items()):
        part = f"part{i % 2}.safetensors"
        f = parts.setdefault(part, SourceFile(f"/u/{part}", 0, {}))
        dt = DTYPES.get(name, dtypes.FLOAT32)
        f.tensors[rename.get(name, name)] = SourceTensor(dt, shape, math.prod(shape) * dt.itemsize)
        name_to_file[name] = part
    return parts, name_to_file


def _assert_same_split(
    parts: dict[str, SourceFile],
    name_to_file: dict[str, str],
    hyper: SourceFile | None,
    dst: StrategyFile,
    rename: dict[str, str],
    ranks: list[int] | None = None,
    bulk: bool = False,
) -> None:
    wanted = ranks if ranks is not None else list(range(_total(dst)))
    fast = _outcome(lambda: plan_split(parts, name_to_file, hyper, dst, "/out", "safetensors", ranks, rename))
    ref = _outcome(
        lambda: _plan_split_reference(
            _SplitJob(parts, name_to_file, hyper, dst, "/out", "safetensors", wanted, rename, "net")
        )
    )
    if isinstance(ref, str) or isinstance(fast, str):
        assert fast == ref
        return
    assert fast.sources == ref.sources
    for a, b in zip(fast.files, ref.files, strict=True):
        assert isinstance(a.tensors, RankTensors) or not bulk
        assert (a.path, a.rank, a.metadata) == (b.path, b.rank, b.metadata)
        assert tuple(a.tensors) == b.tensors
    assert fast.summary() == ref.summary()


def _total(sf: StrategyFile) -> int:
    return device_num(sf) * stage_count(sf)


@SETTINGS
@given(data=st.data())
def test_split_matches_the_reference(data: st.DataObject) -> None:
    n, pp = data.draw(st.sampled_from([2, 4, 6, 8])), data.draw(st.sampled_from([1, 2]))
    dst = data.draw(strategies(n, pp))
    rename = {"w": "model.w"} if data.draw(st.booleans()) else {}
    parts, name_to_file = _unified(PARAMS, rename)
    hyper = SourceFile("/u/hyper.safetensors", 0, {EXTRA: SourceTensor(dtypes.INT64, (1,), 8)})
    ranks = data.draw(st.none() | st.lists(st.integers(0, n * pp - 1), min_size=1, max_size=4))
    _assert_same_split(parts, name_to_file, hyper if data.draw(st.booleans()) else None, dst, rename, ranks, True)


def test_split_cases_left_to_the_reference() -> None:
    """Empty tensors and hyper parameters named like strategy parameters, and a layout error."""
    dst = make_strategy({"w": ParamLayout((2, 2), (1, 0)), "z": ParamLayout((2, 2), (0, -1))})
    parts, name_to_file = _unified({"w": (12, 24), "z": (0, 4)}, {})
    _assert_same_split(parts, name_to_file, None, dst, {})
    parts, name_to_file = _unified({"w": (12, 24), "z": (4, 4)}, {})
    hyper = SourceFile("/u/hyper.safetensors", 0, {"z": SourceTensor(dtypes.INT64, (1,), 8)})
    _assert_same_split(parts, name_to_file, hyper, dst, {})
    parts, name_to_file = _unified({"w": (12, 24), "z": (3, 4)}, {})
    _assert_same_split(parts, name_to_file, hyper, dst, {})
    with pytest.raises(ReshardError):
        plan_split(parts, name_to_file, hyper, dst, "/out", "safetensors")
