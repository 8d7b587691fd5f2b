"""Convert and Hugging Face: whole files to the other format, and full models as sharded folders.

``plan_convert`` turns whole files into the other format (docs/formats.md §5), names optionally mapped,
keeping the strings a ``.ckpt`` may hold in the safetensors metadata. The Hugging Face side of a
full model lives here too, because it is a question of how full tensors are grouped into files:
``plan_hf_shards`` / ``hf_sharded`` / ``plan_unify_hf`` write a full model as Hugging Face shards
and an index (the rules are ``reshard.formats.hf_index``'s), and ``plan_transform_full`` reshards
a full model spread over several files (a Hugging Face sharded model) exactly like a transform
of the same tensors held in one file, from shared tables with a reference loop behind them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from reshard import dtypes
from reshard.errors import LayoutError, UnsupportedError, UsageError
from reshard.formats import hf_index, rank_dirs
from reshard.layout import LayoutTable, StagedLayout
from reshard.plan.bulk import BuiltFiles, Tables, Template, bulk_or_reference, rank_tensors
from reshard.plan.model import (
    FilePlan,
    Plan,
    Role,
    SourceFile,
    SourcePaths,
    TensorPlan,
    TextOutput,
    output_metadata,
    wanted_ranks,
    whole_tensor,
)
from reshard.plan.transform import TransformPlanner, stage_cut
from reshard.plan.unify import ChoiceFunc, plan_unify

STRING_META_PREFIX = "reshard.str:"  # safetensors cannot hold strings; we keep them in the metadata


def plan_convert(pairs: Sequence[tuple[SourceFile, str, str]], name_map: Mapping[str, str] | None = None) -> Plan:
    """Plan format conversion of whole files: (source, output path, output format) triples.

    MindSpore's ``safetensors_to_ckpt`` writes parameters in sorted-name order (its loader sorts),
    ``ckpt_to_safetensors`` keeps file order (irrelevant: safetensors orders by dtype and name).
    MindSpore cannot convert a ``.ckpt`` holding strings; we store each string in the safetensors
    metadata under ``reshard.str:<name>`` and restore it on the way back. Files without strings get
    exactly MindSpore's bytes.
    """
    interned = SourcePaths()
    files = []
    rename = dict(name_map or {})
    for src, out_path, out_fmt in pairs:
        from_st = src.path.endswith(".safetensors")
        names = sorted(src.tensors) if out_fmt == "ckpt" and from_st else list(src.tensors)
        tensors: list[TensorPlan] = []
        meta: dict[str, str] = {"format": "ms"} if out_fmt == "safetensors" else {}
        strings = _metadata_strings(src) if out_fmt == "ckpt" and from_st else {}
        for name in sorted(set(names) | set(strings)) if strings else names:
            out = rename.get(name, name)
            if name in strings:
                raw = strings[name].encode("utf-32-le")
                tensors.append(TensorPlan(out, dtypes.STR, (0,), (), len(raw), raw))
            elif src.tensors[name].dtype is dtypes.STR and out_fmt == "safetensors":
                meta[STRING_META_PREFIX + out] = src.strings[name]
            else:
                tensors.append(whole_tensor(interned, src, name, out))
        files.append(FilePlan(out_path, out_fmt, tuple(tensors), tuple(meta.items())))
    return Plan("convert", tuple(interned.paths), tuple(files))


def _metadata_strings(src: SourceFile) -> dict[str, str]:
    return {k[len(STRING_META_PREFIX) :]: v for k, v in src.metadata.items() if k.startswith(STRING_META_PREFIX)}


# --------------------------------------------------------------------------------------------
# Hugging Face sharded safetensors (see reshard.formats.hf_index for the rules and their source)

_ONE_PART = 2**63  # plan_unify's part size that packs every tensor into part0


def plan_hf_shards(
    tensors: Sequence[TensorPlan],
    dst_dir: str,
    max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE,
    metadata: Sequence[tuple[str, str]] = (),
) -> tuple[tuple[FilePlan, ...], tuple[TextOutput, ...]]:
    """Full-model tensors as Hugging Face shards in ``dst_dir``, and the index (none for one shard).

    Tensors keep the given order (that order decides the shards); ``metadata`` (e.g. the strings
    a ``.ckpt`` held) goes into the first shard, after ``{"format": "pt"}``.
    """
    for t in tensors:
        if t.dtype is dtypes.STR:
            raise UnsupportedError(f"{t.name!r} is a string; Hugging Face shards hold tensors only")
    by_name = {t.name: t for t in tensors}
    groups = hf_index.shard_groups([(t.name, t.nbytes) for t in tensors], max_shard_size) or [[]]
    names = hf_index.shard_names(len(groups))
    files = []
    for j, (group, file_name) in enumerate(zip(groups, names, strict=True)):
        meta = (*hf_index.SHARD_METADATA, *(metadata if j == 0 else ()))
        files.append(FilePlan(os.path.join(dst_dir, file_name), "safetensors", tuple(by_name[n] for n in group), meta))
    if len(groups) == 1:
        return tuple(files), ()
    weight_map = {n: file_name for group, file_name in zip(groups, names, strict=True) for n in group}
    text = hf_index.index_text(sum(t.nbytes for t in tensors), weight_map)
    return tuple(files), (TextOutput(os.path.join(dst_dir, hf_index.INDEX_NAME), text),)


def hf_sharded(plan: Plan, dst_dir: str, max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE) -> Plan:
    """``plan`` with its one full-model output written as Hugging Face shards in ``dst_dir`` instead.

    Strings that a safetensors output keeps in its metadata (``reshard.str:<name>``) stay in the
    first shard's metadata; other metadata (``format: ms``) is replaced by ``format: pt``.
    """
    if len(plan.files) != 1:
        raise UsageError(
            f"Hugging Face output needs one full-model file, but this {plan.operation} writes {len(plan.files)}"
        )
    (full,) = plan.files
    strings = tuple((k, v) for k, v in full.metadata if k.startswith(STRING_META_PREFIX))
    files, texts = plan_hf_shards(tuple(full.tensors), dst_dir, max_shard_size, strings)
    return Plan(plan.operation, plan.sources, files, (*plan.texts, *texts))


def plan_unify_hf(
    sources: Mapping[int, SourceFile],
    src: LayoutTable,
    dst_dir: str,
    choice_func: ChoiceFunc | None = None,
    max_shard_size: int = hf_index.DEFAULT_MAX_SHARD_SIZE,
    mapped: Callable[[Plan], Plan] | None = None,
) -> Plan:
    """``plan_unify`` with the full tensors as Hugging Face shards + index instead of parts.

    ``mapped`` (a model map, ``reshard.plan.surgery``) is applied to the full tensors before they
    are packed into shards, so shard sizes and the index are those of the mapped tensors.

    The same tensors as ``unified_safetensors`` (same choice, same renames), in the order they
    first appear in the rank files (rank order); the parameters outside the strategy stay in
    ``hyper_param.safetensors`` beside the shards, outside the index, as in a unified folder.
    """
    whole = plan_unify(sources, src, dst_dir, choice_func, (), part_bytes=_ONE_PART)
    whole = mapped(whole) if mapped is not None else whole
    part0 = os.path.join(dst_dir, "part0.safetensors")
    (part,) = [f for f in whole.files if f.path == part0]
    others = tuple(f for f in whole.files if f.path != part0)
    order: dict[str, int] = {}
    for f in sources.values():
        for name in f.tensors:
            order.setdefault(name, len(order))

    def position(t: TensorPlan) -> int:
        return order.get(t.copies[0].tensor if t.copies else t.name, len(order))

    files, texts = plan_hf_shards(sorted(part.tensors, key=position), dst_dir, max_shard_size)
    return Plan("unify", whole.sources, (*files, *others), texts)


def plan_transform_full(
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst: LayoutTable | None,
    dst_dir: str,
    prefix: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """``plan_transform`` from a full model spread over several files (a Hugging Face sharded model).

    Each name's tensor comes from ``unified[name_to_file[name]]``; names are taken in the map's
    order. With a destination strategy this is exactly a transform of the same tensors held in
    one full file (same tensors, order and errors: names outside the strategy are copied whole to
    every rank); without one, every tensor is copied whole into ``rank_0`` (joining the shards).
    Planned from shared tables like ``plan_split``; anything unusual goes to the reference loop.
    """
    planner = TransformPlanner({}, None, dst)
    wanted = wanted_ranks(ranks, planner.dst_total)
    args = (planner, unified, name_to_file, dst_dir, prefix, output_format, wanted)
    bulk = _plan_transform_full_bulk if dst is not None else None
    return bulk_or_reference(bulk, _plan_transform_full_reference, *args)


def _plan_transform_full_reference(
    planner: TransformPlanner,
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst_dir: str,
    prefix: str,
    output_format: str,
    wanted: Sequence[int],
) -> Plan:
    """``plan_transform_full`` one parameter and rank at a time (``TransformPlanner.plan_rank``'s loop)."""
    interned = SourcePaths()
    files = []
    for rank in wanted:
        dst_map = planner.dst_map(rank)
        if dst_map is None:
            tensors = tuple(whole_tensor(interned, unified[f], name) for name, f in name_to_file.items())
        else:
            cut = stage_cut(None, dst_map, rank // planner.n_dst)
            to_transform, deferred = cut.sort(name_to_file)
            transformed = [
                planner.transform_one(
                    name, None, dst_map[name].layout, {0: unified[name_to_file[name]]}, rank % planner.n_dst, interned
                )
                for name in to_transform
            ]
            if not transformed:
                raise LayoutError("none of the checkpoint's parameters is in the source or destination strategy")
            tensors = (*transformed, *(whole_tensor(interned, unified[name_to_file[n]], n) for n in deferred))
        path = rank_dirs.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, tuple(tensors), output_metadata(output_format), rank))
    return Plan("transform", tuple(interned.paths), tuple(files))


def _plan_transform_full_bulk(
    planner: TransformPlanner,
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst_dir: str,
    prefix: str,
    output_format: str,
    wanted: Sequence[int],
) -> Plan | None:
    """``plan_transform_full`` from shared tables (one template per destination stage), or None."""
    tables, interned, built = Tables(), SourcePaths(), BuiltFiles()
    templates: dict[int, Template | None] = {}
    files = []
    for rank in wanted:
        stage = rank // planner.n_dst
        if stage not in templates:
            dst_map = planner.dst_map(rank)
            assert dst_map is not None  # the reference path plans a transform without destination strategy
            templates[stage] = _full_template(tables, unified, name_to_file, dst_map, stage)
        template = templates[stage]
        if template is None:
            return None
        path = rank_dirs.rank_output(dst_dir, rank, prefix, output_format)
        files.append(
            FilePlan(
                path,
                output_format,
                rank_tensors(template, rank % planner.n_dst, False, interned, built),
                output_metadata(output_format),
                rank,
            )
        )
    return Plan("transform", tuple(interned.paths), tuple(files))


def _full_template(
    tables: Tables,
    unified: Mapping[str, SourceFile],
    name_to_file: Mapping[str, str],
    dst_map: Mapping[str, StagedLayout],
    stage: int,
) -> Template | None:
    """The tensors of one destination stage; None where the reference loop must decide (empty
    tensors, or nothing to transform: it raises the error)."""
    cut = stage_cut(None, dst_map, stage)
    template = Template()
    for name, file_id in name_to_file.items():
        src = unified[file_id]
        role = cut.role(name)
        if role is Role.SKIP:
            continue
        if role is Role.WHOLE:
            template.deferred.append((name, {0: src}))
            continue
        t = src.tensors[name]
        if not all(t.shape):
            return None
        template.add(tables.get(None, dst_map[name].layout, t.shape), name, name, t.dtype, {0: src})
        template.device_n = 1  # a full source: one device
    if template.device_n is None:
        return None
    template.finish()
    return template


__all__ = [
    "STRING_META_PREFIX",
    "hf_sharded",
    "plan_convert",
    "plan_hf_shards",
    "plan_transform_full",
    "plan_unify_hf",
]
