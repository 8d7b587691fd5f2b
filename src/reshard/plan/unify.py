"""Unify and split: a distributed checkpoint to full tensors, and full tensors back to ranks.

``plan_unify`` reproduces MindSpore's ``unified_safetensors`` (docs/formats.md §4.1): which parameters are
kept and renamed (``choice_func``), how the full tensors are packed greedily into ~3 GiB parts, the
``param_name_map.json`` index and the hyper parameters file. ``plan_split`` reproduces
``load_distributed_checkpoint``'s save mode (docs/formats.md §4.3): a unified model sliced for every
destination rank. Unify assembles each full tensor from its chunk boxes (``reshard.plan.boxes``),
the same copies ``TransformPlanner.transform_one`` plans, which still decides where the chunks
fail (so errors keep its wording); split is planned like a transform from full tensors (shared
tables, lazy ``RankTensors``), with a plain reference loop that decides whenever the fast path
meets anything unusual.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

from reshard import layout
from reshard.errors import ReshardError, UsageError
from reshard.formats import rank_dirs
from reshard.layout import LayoutTable, ParamLayout, StagedLayout, device_num, layout_map, stage_count
from reshard.layout.chunks import whole_box
from reshard.plan.boxes import Indexes, assembled_tensor, source_chunks
from reshard.plan.bulk import BuiltFiles, Tables, Template, bulk_or_reference, rank_tensors
from reshard.plan.model import (
    FilePlan,
    Plan,
    SourceFile,
    SourcePaths,
    TensorPlan,
    TextOutput,
    assembled,
    output_metadata,
    rank_ranges,
    wanted_ranks,
    whole_tensor,
)
from reshard.plan.transform import TransformPlanner

PART_BYTES = 3 * 1024**3  # unified_safetensors' part size (docs/formats.md §4.1 step 6)
REDUNDANT_STATE_PREFIXES = ("accu_grads", "adam_v", "adam_m")

ChoiceFunc = Callable[[str], object]


# --------------------------------------------------------------------------------------------
# unify (docs/formats.md §4.1)


def _bin_pack(sizes: Sequence[tuple[str, int]], groups: int) -> list[list[str]]:
    """Greedy: largest first (stable), each into the group with the smallest total (first on ties)."""
    order = sorted(sizes, key=lambda item: -item[1])
    bins: list[list[str]] = [[] for _ in range(groups)]
    totals = [0] * groups
    for name, size in order:
        i = totals.index(min(totals))
        bins[i].append(name)
        totals[i] += size
    return bins


def _choice(choice_func: ChoiceFunc | None, name: str) -> object:
    if choice_func is None:
        return True
    result = choice_func(name)
    if not isinstance(result, (bool, str)):
        raise UsageError(f"choice_func must return bool or str, got {type(result).__name__} for {name!r}")
    return result


def plan_unify(
    sources: Mapping[int, SourceFile],
    src: LayoutTable,
    dst_dir: str,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    part_bytes: int = PART_BYTES,
) -> Plan:
    """Plan ``unified_safetensors``: full tensors in ~3 GiB parts, an index, and hyper parameters."""
    planner = TransformPlanner(sources, src, None)
    needed = planner.needed(0)
    missing = [r for r in needed if r not in planner.files]
    if missing:
        where = os.path.dirname(os.path.dirname(next(iter(planner.files.values())).path)) if planner.files else None
        raise UsageError(f"no folder for rank(s) {rank_ranges(sorted(missing))}, which the full tensors need", where)
    planner.check_agreement()
    src_map = planner.src_map or {}
    actual = {n for f in planner.files.values() for n in f.tensors}
    name_set = {n for n in actual & set(src_map) if not n.startswith("accu_grads")}
    sizes: dict[str, int] = {}
    renamed: dict[str, str] = {}
    rejected: set[str] = set()
    for f in planner.files.values():
        for name, t in f.tensors.items():
            if name not in name_set or name in sizes or name in rejected:
                continue
            choice = _choice(choice_func, name)
            if choice is False:
                rejected.add(name)
                continue
            if isinstance(choice, str):
                renamed[name] = choice
            full = layout.full_shape(src_map[name].layout, t.shape)
            sizes[name] = math.prod(full) * t.dtype.itemsize
    name_set -= rejected
    total = sum(sizes.values())
    split_num = max(1, min(math.ceil(total / part_bytes), len(sizes))) if sizes else 1
    groups = _bin_pack(list(sizes.items()), split_num)
    selected = _split_selection(len(groups), split_dst_file)
    interned = SourcePaths()
    files: list[FilePlan] = []
    texts: list[TextOutput] = []
    holders: dict[str, dict[int, SourceFile]] = {}
    for r in needed:
        for name in planner.files[r].tensors:
            holders.setdefault(name, {})[r % planner.n_src] = planner.files[r]
    read_ranks = list(dict.fromkeys(needed))  # each source file's metadata once, in load order
    indexes = Indexes()
    for j in selected:
        tensors = [
            _full_tensor(planner, name, src_map[name].layout, holders[name], interned, indexes) for name in groups[j]
        ]
        tensors = [TensorPlan(renamed.get(t.name, t.name), t.dtype, t.shape, t.copies, t.nbytes) for t in tensors]
        meta: dict[str, str] = {"format": "ms"}
        for r in read_ranks:  # MindSpore merges in set order; ours is the load order: same bytes every run
            meta.update(planner.files[r].metadata)
        if "remove_redundancy" in meta:
            meta["remove_redundancy"] = "False"
        files.append(
            FilePlan(os.path.join(dst_dir, f"part{j}.safetensors"), "safetensors", tuple(tensors), tuple(meta.items()))
        )
    if not split_dst_file or split_dst_file[0] == 1:
        rank0 = planner.files.get(0)
        if rank0 is not None:
            hyper = tuple(whole_tensor(interned, rank0, n) for n in rank0.tensors if n not in name_set)
            if hyper:
                files.append(
                    FilePlan(
                        os.path.join(dst_dir, "hyper_param.safetensors"), "safetensors", hyper, (("format", "ms"),)
                    )
                )
        weight_map = {renamed.get(n, n): f"part{j}.safetensors" for j, g in enumerate(groups) for n in g}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        texts.append(TextOutput(os.path.join(dst_dir, "param_name_map.json"), json.dumps(index, indent=4)))
    return Plan("unify", tuple(interned.paths), tuple(files), tuple(texts))


def _full_tensor(
    planner: TransformPlanner,
    name: str,
    p: ParamLayout,
    by_key: Mapping[int, SourceFile],
    sources: SourcePaths,
    indexes: Indexes,
) -> TensorPlan:
    """The full tensor ``name``, assembled from its chunks (``reshard.plan.boxes``): each distinct slice
    from the lowest source rank holding it, the copy ``TransformPlanner.transform_one`` picks too
    (``tests/test_plan_boxes.py``). Where the chunks fail, the reference raises its blamed error."""
    try:
        full = layout.full_shape(p, next(iter(by_key.values())).tensors[name].shape)
        return assembled_tensor(sources, source_chunks(name, p, full, by_key), whole_box(full), indexes=indexes)
    except ReshardError:
        return planner.transform_one(name, p, None, by_key, 0, sources)


def _split_selection(count: int, split_dst_file: tuple[int, int] | tuple[()]) -> list[int]:
    if not split_dst_file:
        return list(range(count))
    index, parts = split_dst_file
    if not (isinstance(index, int) and isinstance(parts, int) and 1 <= index <= parts):
        raise UsageError(f"split_dst_file must be (i, n) with 1 <= i <= n, got {split_dst_file}")
    base, extra = divmod(count, parts)
    start = (index - 1) * base + min(index - 1, extra)
    stop = start + base + (1 if index - 1 < extra else 0)
    return list(range(start, stop))


# --------------------------------------------------------------------------------------------
# split a unified model into per-rank files (docs/formats.md §4.3)


def plan_split(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    hyper: SourceFile | None,
    dst: LayoutTable,
    dst_dir: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
    name_map: Mapping[str, str] | None = None,
    file_name: str = "net",
) -> Plan:
    """Plan ``load_distributed_checkpoint`` save mode: slice full tensors for every destination rank.

    ``name_to_file`` maps *strategy* names to part files; the tensor is read under the file key
    ``name_map[name]`` (MindFormers renames keys but keeps original names in the index).
    Planned like a transform from full tensors (shared tables, lazy ``RankTensors``); when that
    fast path meets anything unusual, the reference loop ``_plan_split_reference`` decides.
    """
    wanted = wanted_ranks(ranks, device_num(dst) * stage_count(dst))
    args = (unified, name_to_file, hyper, dst, dst_dir, output_format, wanted, name_map or {}, file_name)
    return bulk_or_reference(_plan_split_bulk, _plan_split_reference, *args)


def _split_path(dst_dir: str, rank: int, file_name: str, output_format: str) -> str:
    return os.path.join(rank_dirs.rank_dir(dst_dir, rank), f"{file_name}.{output_format}")


def _split_params(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst_map: Mapping[str, StagedLayout],
    stage: int,
    name_map: Mapping[str, str],
) -> Iterator[tuple[str, StagedLayout, str, SourceFile]]:
    """(strategy name, layout, file key, source) of every parameter a split writes for ``stage``:
    in the strategy's order, present in its unified file under ``name_map``'s key."""
    for name, staged in dst_map.items():
        if stage not in staged.stages:
            continue
        key = name_map.get(name, name)
        file_id = name_to_file.get(name)
        if file_id is None or file_id not in unified or key not in unified[file_id].tensors:
            continue
        yield name, staged, key, unified[file_id]


def _plan_split_reference(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    hyper: SourceFile | None,
    dst: LayoutTable,
    dst_dir: str,
    output_format: str,
    wanted: Sequence[int],
    name_map: Mapping[str, str],
    file_name: str,
) -> Plan:
    """``plan_split``, one parameter and rank at a time (the definition; raises the user's errors)."""
    n_dst = device_num(dst)
    interned = SourcePaths()
    files = []
    for rank in wanted:
        dst_map = layout_map(dst, rank)
        stage = rank // n_dst
        tensors: dict[str, TensorPlan] = {}  # MindSpore's dict order: strategy names, then hyper params
        for name, staged, key, src in _split_params(unified, name_to_file, dst_map, stage, name_map):
            full = src.tensors[key].shape
            box = layout.rank_box(staged.layout, full, rank % n_dst)
            full_box = tuple((0, d) for d in full)
            tensors[name] = assembled(interned, key, name, [(src, full_box, box)], box, src.tensors[key].dtype)
        if hyper is not None:
            for name in hyper.tensors:
                tensors[name] = whole_tensor(interned, hyper, name)
        path = _split_path(dst_dir, rank, file_name, output_format)
        files.append(FilePlan(path, output_format, tuple(tensors.values()), output_metadata(output_format), rank))
    return Plan("split", tuple(interned.paths), tuple(files))


def _plan_split_bulk(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    hyper: SourceFile | None,
    dst: LayoutTable,
    dst_dir: str,
    output_format: str,
    wanted: Sequence[int],
    name_map: Mapping[str, str],
    file_name: str,
) -> Plan | None:
    """``plan_split`` from shared tables, or None where the reference loop must decide.

    The rank-aware layout map (docs/formats.md §2.4) only depends on which layouts' device counts exceed
    the rank, so templates are keyed by that and the stage.
    """
    n_dst = device_num(dst)
    counts = sorted({p.device_num for p in dst.layouts.values()})
    tables, interned, built = Tables(), SourcePaths(), BuiltFiles()
    templates: dict[tuple[int, tuple[bool, ...]], Template] = {}
    meta = output_metadata(output_format)
    files = []
    for rank in wanted:
        key = (rank // n_dst, tuple(rank < n for n in counts))
        template = templates.get(key)
        if template is None:
            template = _split_template(
                tables, unified, name_to_file, hyper, layout_map(dst, rank), rank // n_dst, name_map
            )
            if template is None:
                return None
            templates[key] = template
        files.append(
            FilePlan(
                _split_path(dst_dir, rank, file_name, output_format),
                output_format,
                rank_tensors(template, rank % n_dst, False, interned, built),
                meta,
                rank,
            )
        )
    return Plan("split", tuple(interned.paths), tuple(files))


def _split_template(
    tables: Tables,
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    hyper: SourceFile | None,
    dst_map: Mapping[str, StagedLayout],
    stage: int,
    name_map: Mapping[str, str],
) -> Template | None:
    """The tensors of a split output for one stage; None for what only the reference loop gets right
    (empty tensors: one empty copy there, none in the tables; a hyper parameter replacing a sliced one)."""
    template = Template()
    for name, staged, key, src in _split_params(unified, name_to_file, dst_map, stage, name_map):
        full = src.tensors[key].shape
        if not all(full):
            return None
        template.add(tables.get(None, staged.layout, full), name, key, src.tensors[key].dtype, {0: src})
    if hyper is not None:
        if any(name in hyper.tensors for name in (t.name for t in template.transformed)):
            return None
        template.deferred = [(name, {0: hyper}) for name in hyper.tensors]
    template.finish()
    return template


__all__ = ["PART_BYTES", "REDUNDANT_STATE_PREFIXES", "ChoiceFunc", "plan_split", "plan_unify"]
