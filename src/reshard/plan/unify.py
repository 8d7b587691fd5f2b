"""Unify: a distributed checkpoint to full tensors in parts, as MindSpore's ``unified_safetensors``.

``plan_unify`` reproduces MindSpore's ``unified_safetensors`` (docs/formats.md §4.1): which parameters are
kept and renamed (``choice_func``), how the full tensors are packed greedily into ~3 GiB parts, the
``param_name_map.json`` index and the hyper parameters file (its mirror, a unified model split
to ranks, is ``reshard.plan.split``). Unify assembles each full tensor from its chunk boxes (``reshard.plan.boxes``),
the same copies ``TransformPlanner.transform_one`` plans, which still decides where the chunks
fail (so errors keep its wording).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence

from reshard import layout
from reshard.errors import ReshardError, UsageError
from reshard.layout import LayoutTable, ParamLayout
from reshard.layout.chunks import whole_box
from reshard.plan.boxes import Indexes, assembled_tensor, source_chunks
from reshard.plan.model import (
    FilePlan,
    Plan,
    SourceFile,
    SourcePaths,
    TensorPlan,
    TextOutput,
    rank_ranges,
    whole_tensor,
)
from reshard.plan.transform_reference import TransformPlanner

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


__all__ = ["PART_BYTES", "REDUNDANT_STATE_PREFIXES", "ChoiceFunc", "plan_unify"]
