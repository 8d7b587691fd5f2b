"""Checkpoint 2.0 outputs: a transform's per-rank files regrouped as MindFormers 2.x writes them.

A transform already knows, per destination rank, every tensor and where its bytes come from. A
Checkpoint 2.0 (docs/formats.md §10) holds the same tensors, regrouped and described:

* each rank's tensors split by name into ``model-{rank}-{world}`` and ``opt-{rank}-{world}`` files
  in ``iteration_{n:08d}/`` (``reshard.statenames`` decides which names are training state; the
  ``opt`` file exists only for a rank that holds some);
* a parameter shared by several pipeline stages (tied embeddings) is written once, by the ranks
  of its lowest stage, as MindFormers leaves pipeline-shared copies out of its saves;
* ``metadata.json`` (every tensor's layout over its stage's ranks, its slice ids and the files
  holding each slice), ``common.json``, and the tracker ``latest_checkpointed_iteration.txt``,
  as text outputs in that order: the executor writes texts after every tensor file, in order, so
  the tracker, MindFormers' completion marker, comes last.

The transform must have been planned with the destination strategy *without optimizer shards*
(``reshard.layout.slices.ModelParallelTable``): MindFormers' layout dict cannot express one, so a
rank holds its model-parallel slice. With ``--ranks`` only some ranks' files are written:
``metadata.json`` and ``common.json`` come with rank 0's (as in MindFormers, where rank 0 writes
them) and need the plan of every rank (``everyone``); the tracker only comes with a run that
writes every rank, since nothing here can wait for the other nodes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import LayoutError, UnsupportedError
from reshard.formats import checkpoint2 as cp2
from reshard.formats.checkpoint2 import TensorFacts
from reshard.layout import LayoutTable, opt_shard_size, tensor_strategy
from reshard.plan.bulk import RankTensors
from reshard.plan.model import FilePlan, FileStats, LazyTensors, Plan, Role, TensorPlan, TextOutput
from reshard.plan.transform_reference import StageCut, TransformPlanner
from reshard.statenames import DEFAULT, StateNames

Entry = tuple[str, DType, tuple[int, ...]]
MS_METADATA = (("format", "ms"),)


class SelectedTensors(LazyTensors):
    """Some tensors of another output's tensor list (model or optimizer side), built on access."""

    def __init__(self, parent: Sequence[TensorPlan], indices: tuple[int, ...]) -> None:
        self.parent = parent
        self.indices = indices
        self._stats: FileStats | None = None

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def stats(self) -> FileStats:
        if self._stats is None:
            if isinstance(self.parent, RankTensors):
                self._stats = self.parent.stats_of(self.indices)
            else:
                self._stats = FileStats.of(self.materialise())
        return self._stats

    def materialise(self) -> tuple[TensorPlan, ...]:
        parent = self.parent.materialise() if isinstance(self.parent, RankTensors) else tuple(self.parent)
        return tuple(parent[i] for i in self.indices)


def entries(tensors: Sequence[TensorPlan]) -> tuple[Entry, ...]:
    """(name, dtype, shape) of an output's tensors, in order (lazy lists answer without building)."""
    if isinstance(tensors, RankTensors):
        return tensors.entries()
    return tuple((t.name, t.dtype, t.shape) for t in tensors)


class _Layouts:
    """What the destination strategy says of each (rank, name): its layout and rank list, or
    None (a full tensor), or "leave it out" (a shared parameter outside its lowest stage)."""

    def __init__(self, src: LayoutTable | None, dst: LayoutTable | None) -> None:
        self.planner = TransformPlanner({}, src, dst)
        self.n = self.planner.n_dst
        self.world = self.planner.dst_total
        self._cuts: dict[int, StageCut] = {}
        self._memo: dict[tuple[int, str], TensorFacts | bool | None] = {}

    def of(self, rank: int, name: str) -> TensorFacts | bool | None:
        """False: not written on ``rank``; None: written full; else facts without dtype/shape filled."""
        stage = rank // self.n
        hit = self._memo.get((stage, name), True)
        if hit is True:
            hit = self._memo[(stage, name)] = self._decide(rank, name)
        return hit

    def _decide(self, rank: int, name: str) -> TensorFacts | bool | None:
        dst_map = self.planner.dst_map(rank)
        stage = rank // self.n
        if stage not in self._cuts:
            self._cuts[stage] = self.planner.stage_cut(rank)
        role = self._cuts[stage].role(name)
        if role is Role.WHOLE:
            self._check_whole(name)
        if dst_map is None or name not in dst_map or role is not Role.TRANSFORM:
            return None
        staged = dst_map[name]
        if stage != min(staged.stages):
            return False
        layout = staged.layout
        if layout.device_num != self.n:
            raise UnsupportedError(
                f"parameter {name!r}: its device matrix {list(layout.dev_matrix)} covers {layout.device_num} devices, "
                f"a pipeline stage has {self.n}; a Checkpoint 2.0 layout must cover its stage's ranks",
                self.planner.dst.path if self.planner.dst is not None else None,
            )
        return TensorFacts(dtypes.FLOAT32, (), layout, tuple(range(stage * self.n, (stage + 1) * self.n)))

    def _check_whole(self, name: str) -> None:
        """A tensor copied whole must be whole: not a slice of a source strategy that splits it."""
        staged = (self.planner.src_map or {}).get(name)
        if staged is None:
            return
        p = staged.layout
        if math.prod(tensor_strategy(p)) > 1 or opt_shard_size(p):
            raise UnsupportedError(
                f"parameter {name!r} is split by the source strategy but has no layout in the destination "
                "strategy: its slices cannot be written as one Checkpoint 2.0 tensor; use a destination "
                "strategy that lays it out",
                self.planner.dst.path if self.planner.dst is not None else None,
            )


def _facts(layouts: _Layouts, files: Sequence[FilePlan]) -> tuple[dict[str, TensorFacts], dict[int, list[int]]]:
    """Every tensor's facts, and per rank the positions of the tensors it keeps."""
    facts: dict[str, TensorFacts] = {}
    kept: dict[int, list[int]] = {}
    for f in files:
        assert f.rank is not None
        kept[f.rank] = []
        for i, (name, dtype, shape) in enumerate(entries(f.tensors)):
            found = layouts.of(f.rank, name)
            if found is False:
                continue
            first = facts.get(name)
            if first is None:
                layout = found.layout if isinstance(found, TensorFacts) else None
                ranks = found.rank_list if isinstance(found, TensorFacts) else (f.rank,)
                first = facts[name] = TensorFacts(dtype, cp2.global_shape(layout, shape), layout, ranks)
                _check_dtype(name, dtype)
            elif dtype is not first.dtype or shape != first.local_shape:
                raise LayoutError(
                    f"{name!r} would be {first.dtype.ms_name}{list(first.local_shape)} on one rank and "
                    f"{dtype.ms_name}{list(shape)} on another",
                    f.path,
                )
            kept[f.rank].append(i)
    return facts, kept


def _check_dtype(name: str, dtype: DType) -> None:
    if dtype is dtypes.STR or dtype.st_code is None:
        raise UnsupportedError(
            f"{name!r} is a {dtype.ms_name}; Checkpoint 2.0 tensor files (safetensors) cannot hold it"
        )


def plan_checkpoint2(
    plan: Plan,
    src: LayoutTable | None,
    dst: LayoutTable | None,
    root: str,
    *,
    iteration: int = cp2.DEFAULT_ITERATION,
    common: Mapping[str, object] | None = None,
    prefix: str = "",
    state_names: StateNames = DEFAULT,
    everyone: Plan | None = None,
) -> Plan:
    """``plan`` (a transform's per-rank outputs) as a Checkpoint 2.0 under ``root``.

    Args:
        plan: The transform plan of the ranks to write (``FilePlan.rank`` set; paths ignored).
        src: The source strategy the transform was planned with (None: a full model).
        dst: The destination strategy it was planned with, without optimizer shards (None: one rank).
        root: The checkpoint root (``iteration_{n:08d}/`` and the tracker go there).
        iteration: The iteration number.
        common: ``common.json``'s values (see ``reshard.formats.checkpoint2.check_common``).
        prefix: MindFormers' ``user_prefix`` ("": none).
        state_names: Which names go to the ``opt-…`` files.
        everyone: The plan of every destination rank when ``plan`` holds only some (``metadata.json``
            lists every rank's files); None: ``plan`` holds them all.

    Returns:
        The plan: tensor files per rank, then ``metadata.json`` (several ranks), ``common.json``
        (with rank 0) and the tracker (when every rank is written), in that order.

    Raises:
        UnsupportedError: A string or a dtype safetensors cannot hold, or a layout whose device
            matrix does not cover its pipeline stage.
        LayoutError: One tensor planned with different dtypes or shapes on different ranks.

    Example:
        from reshard.api import Destination, transform
        from reshard.plan.checkpoint2 import plan_checkpoint2
        per_rank = transform("demo/full/model.ckpt", "unused", destination=Destination(dry_run=True)).plan
        plan = plan_checkpoint2(per_rank, None, None, "cp2", iteration=10)
    """
    common_values = cp2.check_common(common)
    cp2.check_iteration(iteration)
    layouts = _Layouts(src, dst)
    world = layouts.world
    facts, kept = _facts(layouts, plan.files)
    is_state = {name: state_names.is_state(name) for name in facts}
    folder = cp2.iteration_dir(root, iteration)
    files: list[FilePlan] = []
    for f in plan.files:
        assert f.rank is not None
        names = entries(f.tensors)
        for kind, indices in _sides(kept[f.rank], names, is_state):
            if kind == cp2.OPTIMIZER and not indices:
                continue
            path = os.path.join(folder, cp2.file_name(kind, f.rank, world, prefix))
            files.append(FilePlan(path, "safetensors", SelectedTensors(f.tensors, indices), MS_METADATA, f.rank))
    written = {f.rank for f in plan.files}
    texts: list[TextOutput] = []
    if 0 in written:
        if world > 1:
            all_facts, all_kept = _facts(layouts, everyone.files) if everyone is not None else (facts, kept)
            source = everyone.files if everyone is not None else plan.files
            all_state = {name: state_names.is_state(name) for name in all_facts}
            text = _metadata(source, all_facts, all_kept, world, prefix, all_state)
            texts.append(TextOutput(os.path.join(folder, cp2.METADATA_NAME), text))
        texts.append(TextOutput(os.path.join(folder, cp2.COMMON_NAME), cp2.common_text(common_values)))
    if written == set(range(world)):
        texts.append(TextOutput(os.path.join(root, cp2.TRACKER_NAME), cp2.tracker_text(iteration)))
    return Plan(plan.operation, plan.sources, tuple(files), tuple(texts))


def _sides(
    kept: Sequence[int], names: Sequence[Entry], is_state: Mapping[str, bool]
) -> tuple[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]:
    model = tuple(i for i in kept if not is_state[names[i][0]])
    opt = tuple(i for i in kept if is_state[names[i][0]])
    return (cp2.MODEL, model), (cp2.OPTIMIZER, opt)


def _metadata(
    files: Sequence[FilePlan],
    facts: Mapping[str, TensorFacts],
    kept: Mapping[int, Sequence[int]],
    world: int,
    prefix: str,
    is_state: Mapping[str, bool],
) -> str:
    holdings: list[tuple[int, list[str]]] = []
    file_of: dict[tuple[int, str], str] = {}
    for f in sorted(files, key=lambda f: f.rank or 0):
        assert f.rank is not None
        names = entries(f.tensors)
        held = [names[i][0] for i in kept[f.rank]]
        holdings.append((f.rank, held))
        names_of = {kind: cp2.file_name(kind, f.rank, world, prefix) for kind in (cp2.MODEL, cp2.OPTIMIZER)}
        for name in held:
            file_of[(f.rank, name)] = names_of[cp2.OPTIMIZER if is_state[name] else cp2.MODEL]
    # a full tensor's rank list is every rank holding it
    holders: dict[str, list[int]] = {}
    for rank, held in holdings:
        for name in held:
            holders.setdefault(name, []).append(rank)
    complete = {
        name: f if f.layout is not None else TensorFacts(f.dtype, f.global_shape, None, tuple(holders[name]))
        for name, f in facts.items()
    }
    return cp2.metadata_text(complete, holdings, file_of)


__all__ = ["SelectedTensors", "entries", "plan_checkpoint2"]
