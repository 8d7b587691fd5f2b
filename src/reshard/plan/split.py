"""Split: a unified model (full tensors) sliced for every destination rank of a strategy.

``plan_split`` reproduces ``load_distributed_checkpoint``'s save mode (docs/formats.md §4.3). It is
planned like a transform from full tensors (shared tables, lazy ``RankTensors`` of
``reshard.plan.bulk``), with a plain reference loop that decides whenever the fast path meets
anything unusual.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from reshard import layout
from reshard.formats import rank_dirs
from reshard.layout import LayoutTable, StagedLayout, device_num, layout_map, stage_count
from reshard.plan.bulk import BuiltFiles, Tables, Template, bulk_or_reference, rank_tensors
from reshard.plan.model import (
    FilePlan,
    Plan,
    SourceFile,
    SourcePaths,
    TensorPlan,
    assembled,
    output_metadata,
    wanted_ranks,
    whole_tensor,
)

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
    job = _SplitJob(unified, name_to_file, hyper, dst, dst_dir, output_format, wanted, name_map or {}, file_name)
    return bulk_or_reference(_plan_split_bulk, _plan_split_reference, job)


@dataclass(frozen=True)
class _SplitJob:
    """What both split planners take: ``plan_split``'s arguments, the ranks resolved."""

    unified: Mapping[str, SourceFile]
    name_to_file: Mapping[str, str]
    hyper: SourceFile | None
    dst: LayoutTable
    dst_dir: str
    output_format: str
    wanted: Sequence[int]
    name_map: Mapping[str, str]
    file_name: str


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


def _plan_split_reference(job: _SplitJob) -> Plan:
    """``plan_split``, one parameter and rank at a time (the definition; raises the user's errors)."""
    unified, hyper, dst, output_format = job.unified, job.hyper, job.dst, job.output_format
    n_dst = device_num(dst)
    interned = SourcePaths()
    files = []
    for rank in job.wanted:
        dst_map = layout_map(dst, rank)
        stage = rank // n_dst
        tensors: dict[str, TensorPlan] = {}  # MindSpore's dict order: strategy names, then hyper params
        for name, staged, key, src in _split_params(unified, job.name_to_file, dst_map, stage, job.name_map):
            full = src.tensors[key].shape
            box = layout.rank_box(staged.layout, full, rank % n_dst)
            full_box = tuple((0, d) for d in full)
            tensors[name] = assembled(interned, key, name, [(src, full_box, box)], box, src.tensors[key].dtype)
        if hyper is not None:
            for name in hyper.tensors:
                tensors[name] = whole_tensor(interned, hyper, name)
        path = _split_path(job.dst_dir, rank, job.file_name, output_format)
        files.append(FilePlan(path, output_format, tuple(tensors.values()), output_metadata(output_format), rank))
    return Plan("split", tuple(interned.paths), tuple(files))


def _plan_split_bulk(job: _SplitJob) -> Plan | None:
    """``plan_split`` from shared tables, or None where the reference loop must decide.

    The rank-aware layout map (docs/formats.md §2.4) only depends on which layouts' device counts exceed
    the rank, so templates are keyed by that and the stage.
    """
    dst, output_format = job.dst, job.output_format
    n_dst = device_num(dst)
    counts = sorted({p.device_num for p in dst.layouts.values()})
    tables, interned, built = Tables(), SourcePaths(), BuiltFiles()
    templates: dict[tuple[int, tuple[bool, ...]], Template] = {}
    meta = output_metadata(output_format)
    files = []
    for rank in job.wanted:
        key = (rank // n_dst, tuple(rank < n for n in counts))
        template = templates.get(key)
        if template is None:
            template = _split_template(tables, job, layout_map(dst, rank), rank // n_dst)
            if template is None:
                return None
            templates[key] = template
        files.append(
            FilePlan(
                _split_path(job.dst_dir, rank, job.file_name, output_format),
                output_format,
                rank_tensors(template, rank % n_dst, False, interned, built),
                meta,
                rank,
            )
        )
    return Plan("split", tuple(interned.paths), tuple(files))


def _split_template(tables: Tables, job: _SplitJob, dst_map: Mapping[str, StagedLayout], stage: int) -> Template | None:
    """The tensors of a split output for one stage; None for what only the reference loop gets right
    (empty tensors: one empty copy there, none in the tables; a hyper parameter replacing a sliced one)."""
    template, hyper = Template(), job.hyper
    for name, staged, key, src in _split_params(job.unified, job.name_to_file, dst_map, stage, job.name_map):
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


__all__ = ["plan_split"]
