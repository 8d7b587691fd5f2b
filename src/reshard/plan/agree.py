"""The strategy and the files agree: checks run before any plan is made from a strategy and headers.

A checkpoint file stores each rank's *slice* shape, never the global one: the global shape is
derived, ``slice x layout``. A strategy of another job with the right number of ranks therefore
derives wrong global shapes without any error, and a transform writes a scrambled model. What
can be checked, from headers alone, is that the files and the layouts tell one consistent story:

1. every rank of a pipeline stage holds the same slice shape and dtype of a parameter (MindSpore's
   layouts divide evenly, so the layout gives every rank of a stage one slice shape; replicas are
   among them);
2. a parameter held by several stages (a tied embedding) derives one global shape from every
   stage's slices and that stage's own layout;
3. a per-parameter optimizer state (``adam_m.<name>``, ...) derives its parameter's global shape;
4. the layout divides the slices at all (``reshard.layout.full_shape``).

The cost is one comparison per tensor of each *distinct* header table (ranks of a stage that
share one table, as in-memory benchmarks build them, are checked once), so planning 5 000
parameters x 4 096 ranks stays within the planner's budget; a real checkpoint pays one comparison
per tensor header read, far less than reading the header. Nothing here reads tensor data.
What no check can catch is in docs/checks.md ("What no check can catch").

``check_agreement`` is called by ``TransformPlanner.check_agreement`` (every transform, unify,
per-rank and drop-in plan from a strategy) and by ``reshard inspect --strategy``; a failed check is
a ``LayoutError`` naming the parameter, the ranks and the two facts that disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from reshard import layout
from reshard.errors import LayoutError
from reshard.layout import LayoutTable, ParamLayout, split_stage_name
from reshard.plan.model import SourceFile, SourceTensor
from reshard.statenames import CLONE_PREFIXES
from reshard.text import indefinite


@dataclass
class Agreement:
    """What ``check_agreement`` checked: parameters, ranks, and the global shapes it derived."""

    parameters: int = 0
    ranks: int = 0
    full_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Seen:
    """The first slice of a parameter found in one stage: which rank holds it, and the slice."""

    rank: int
    tensor: SourceTensor


@dataclass
class _Stage:
    """What one stage's files showed so far: each parameter's first slice, the header tables checked."""

    layouts: Mapping[str, ParamLayout]
    first: dict[str, _Seen] = field(default_factory=dict)
    checked: set[int] = field(default_factory=set)  # ids of header tables already checked


def describe(p: ParamLayout) -> str:
    """A layout as a message names it: ``dev matrix [2, 2], tensor map [-1, 0], opt shard 2``."""
    tmap = [list(e) if isinstance(e, tuple) else e for e in p.tensor_map]
    text = f"dev matrix {list(p.dev_matrix)}, tensor map {tmap}"
    if p.opt_shard_size:
        text += f", opt shard {p.opt_shard_size}"
    return text


def stage_tables(strategy: LayoutTable) -> dict[int, dict[str, ParamLayout]]:
    """stage -> parameter -> the layout of that stage (merged files name items ``"<stage>-<name>"``)."""
    tables: dict[int, dict[str, ParamLayout]] = {}
    for key, p in strategy.layouts.items():
        stage, name = split_stage_name(key, strategy.path)
        tables.setdefault(stage, {})[name] = p
    return tables


def check_agreement(files: Mapping[int, SourceFile], strategy: LayoutTable, per_stage: int) -> Agreement:
    """Refuse files and a strategy that disagree (the module docstring lists the checks).

    ``per_stage`` is the strategy's devices per stage; files of ranks beyond its stages are not
    looked at (the rank-count checks word that).
    """
    stages = {s: _Stage(table) for s, table in stage_tables(strategy).items()}
    ranks = 0
    for rank in sorted(files):
        stage = stages.get(rank // per_stage)
        if stage is not None:
            ranks += 1
            _check_slices(files[rank], rank, rank // per_stage, stage, strategy)
    full_shapes = _global_shapes(stages, strategy)
    _check_states(full_shapes, stages, strategy)
    return Agreement(len(full_shapes), ranks, full_shapes)


def _check_slices(src: SourceFile, rank: int, index: int, stage: _Stage, strategy: LayoutTable) -> None:
    """Every slice of ``src`` the stage's layouts describe is the one the stage's first holder has."""
    if id(src.tensors) in stage.checked:
        return
    stage.checked.add(id(src.tensors))
    layouts, first = stage.layouts, stage.first
    for name, t in src.tensors.items():
        p = layouts.get(name)
        if p is None:
            continue
        seen = first.get(name)
        if seen is None:
            first[name] = _Seen(rank, t)
        elif seen.tensor.shape != t.shape or seen.tensor.dtype != t.dtype:
            raise LayoutError(
                f"{name}: rank {rank} holds {_fact(t)} but rank {seen.rank} holds {_fact(seen.tensor)}, and the "
                f"strategy's layout ({describe(p)}) gives every rank of stage {index} the same slice: "
                "is it this checkpoint's strategy?",
                strategy.path,
            )


def _global_shapes(stages: Mapping[int, _Stage], strategy: LayoutTable) -> dict[str, tuple[int, ...]]:
    """Each parameter's global shape, derived in every stage holding it; stages must agree."""
    shapes: dict[str, tuple[int, ...]] = {}
    derived_in: dict[str, tuple[int, _Seen, ParamLayout]] = {}
    for index in sorted(stages):
        stage = stages[index]
        for name, seen in stage.first.items():
            p = stage.layouts[name]
            full = _full_shape(name, p, seen, strategy)
            before = derived_in.get(name)
            if before is None:
                shapes[name] = full
                derived_in[name] = (index, seen, p)
            elif shapes[name] != full:
                s0, seen0, p0 = before
                raise LayoutError(
                    f"{name}: stage {s0}'s layout ({describe(p0)}) and rank {seen0.rank}'s slice "
                    f"{list(seen0.tensor.shape)} give {indefinite(list(shapes[name]))} tensor, but stage {index}'s "
                    f"layout ({describe(p)}) and rank {seen.rank}'s slice {list(seen.tensor.shape)} give {list(full)}; "
                    "a parameter shared by pipeline stages has one shape: is it this checkpoint's strategy?",
                    strategy.path,
                )
    return shapes


def _full_shape(name: str, p: ParamLayout, seen: _Seen, strategy: LayoutTable) -> tuple[int, ...]:
    try:
        return layout.full_shape(p, seen.tensor.shape)
    except LayoutError as exc:
        raise LayoutError(
            f"{name}: rank {seen.rank} holds {_fact(seen.tensor)}, which the strategy's layout ({describe(p)}) "
            f"does not describe: {exc.detail}",
            strategy.path,
        ) from None


def _check_states(shapes: Mapping[str, tuple[int, ...]], stages: Mapping[int, _Stage], strategy: LayoutTable) -> None:
    """A per-parameter optimizer state has its parameter's global shape."""
    for name, full in shapes.items():
        param = _parameter_of(name)
        if param is None or param not in shapes or shapes[param] == full:
            continue
        state, weight = _holder(stages, name), _holder(stages, param)
        raise LayoutError(
            f"{name}: rank {state.rank}'s slice {list(state.tensor.shape)} and the strategy give "
            f"{indefinite(list(full))} tensor, but its parameter {param} (rank {weight.rank}'s slice "
            f"{list(weight.tensor.shape)}) is "
            f"{list(shapes[param])}: is it this checkpoint's strategy?",
            strategy.path,
        )


def _parameter_of(name: str) -> str | None:
    for prefix in CLONE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _holder(stages: Mapping[int, _Stage], name: str) -> _Seen:
    return next(stage.first[name] for _, stage in sorted(stages.items()) if name in stage.first)


def _fact(t: SourceTensor) -> str:
    return f"{t.dtype.ms_name} {list(t.shape)}"


def first_stage_alone(files: Mapping[int, SourceFile], strategy: LayoutTable, stage: int | None) -> bool:
    """Whether ``strategy`` is one pipeline stage's file (its ``stage``) of the job that saved ``files``.

    MindSpore's ``unified_safetensors`` given rank 0's strategy of a 2-stage job (its own system
    test does) reads ranks 0..n-1 with it and unifies that stage's parameters. That is right only
    for the first stage, whose ranks are 0..n-1: it is recognised by an unmerged strategy (no
    ``"<stage>-"`` names) and rank folders in whole stages of n, the later ones holding parameters
    the first stage's do not (a pipeline job's other stages). The same count of folders holding
    the same names is another job's checkpoint, and is refused.
    """
    if stage not in (None, 0) or any(split_stage_name(k, strategy.path)[0] for k in strategy.layouts):
        return False
    per_stage = layout.device_num(strategy)
    ranks = sorted(files)
    if len(ranks) <= per_stage or len(ranks) % per_stage or ranks != list(range(len(ranks))):
        return False
    first = {n for r in ranks[:per_stage] for n in files[r].tensors}
    return any(n not in first for r in ranks[per_stage:] for n in files[r].tensors)


__all__ = ["Agreement", "check_agreement", "describe", "first_stage_alone", "stage_tables"]
