"""What the operations add for a chunked source (a PyTorch DCP folder): its tensors as one full model.

A DCP folder holds boxes of each global tensor, not MindSpore layouts, so it is planned from its
chunk boxes (``reshard.plan.boxes``) and never through a strategy. To give it every operation's
outputs (a full file, Hugging Face shards, unify's parts, MindSpore rank folders of a destination
strategy) and the one tensor pipeline (filters, casts, maps) without a second copy of each
planner, the source is first seen as one *virtual* full model (``virtual_model``: one file holding
every global tensor whole, at a path no executor reads), planned by the planners every full model
goes through, and the plan is then re-sourced (``resourced``): each copy of a box of a global
tensor becomes the copies of that box from the chunks holding it (``plan.boxes.assembled_tensor``
over the chunking's ``ChunkIndex``, one per chunking). Chunk bytes move as bytes (bf16, fp8), and
a copy that reads through a reshaping view (a model map's stacked layers) reads the box of the
tensor it is, through the same view of each chunk (``plan.views``); a view box that is not one box
of the tensor and of its chunks is refused in one line.

Non-tensor values (opaque ``torch.save`` bytes) are never unpickled; an output that holds tensors
only says in one note how many it does not carry (``values_note``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from reshard import dtypes
from reshard.errors import UnsupportedError
from reshard.formats import dcp
from reshard.formats.distcp_format import NAME as DISTCP
from reshard.layout.chunks import ChunkedTensor
from reshard.plan import Plan, SourceFile, hf_sharded, plan_transform_full
from reshard.plan.boxes import Indexes, OutputFile, Target, assembled_tensor, plan_boxes
from reshard.plan.dcp import Chunking, SourceSlices, data_file_name
from reshard.plan.model import (
    Copy,
    FilePlan,
    QuantizedSource,
    SourcePaths,
    SourceTensor,
    TensorPlan,
    TextOutput,
    whole_tensor,
)
from reshard.plan.quantized import FP8_BLOCK, MXFP4
from reshard.plan.unify import PART_BYTES, _bin_pack, _choice
from reshard.sources.kind import OpenedChunks

VIRTUAL = dcp.METADATA_NAME  # the virtual full model's file key (its path: the folder's .metadata)


def check_run(run: object) -> None:
    """A chunked source's data files are read through their folder's ``.metadata``: Ray must read them
    where they are (a shared disk), not from shipped copies of the files alone.

    Raises:
        UnsupportedError: ``RayOptions(shared_disk=False)``.
    """
    if getattr(run, "shared_disk", True) is False:
        raise UnsupportedError(
            "a PyTorch DCP source on Ray needs a shared disk (RayOptions(shared_disk=True)): its .distcp files "
            "are read through their folder's .metadata"
        )


def virtual_model(opened: OpenedChunks) -> tuple[dict[str, SourceFile], dict[str, str]]:
    """The source as one full model: a file holding every global tensor whole, and its name -> file map."""
    tensors = {
        name: SourceTensor(t.dtype, t.shape, math.prod(t.shape) * t.dtype.itemsize)
        for name, t in opened.tensors.items()
    }
    path = os.path.join(os.path.abspath(opened.path), dcp.METADATA_NAME)
    return {VIRTUAL: SourceFile(path, 0, tensors)}, dict.fromkeys(tensors, VIRTUAL)


VALUES_NOT_CARRIED = "non-tensor values not carried"  # the words of values_note (a face that writes nothing drops it)


def values_note(opened: OpenedChunks, notes: list[str], output: str) -> None:
    """One note for the non-tensor values an output that holds tensors only does not carry."""
    if opened.values:
        notes.append(f"{len(opened.values)} {VALUES_NOT_CARRIED}: {output} holds tensors only")


def resourced(plan: Plan, opened: OpenedChunks, computed: dict[tuple[str, str], QuantizedSource] | None = None) -> Plan:
    """``plan`` (from ``virtual_model``) reading the chunks: each copy of a box of a global tensor
    becomes the copies of that box from the chunks holding it, the sources interned anew.

    ``computed``: the run's ``--dequantize`` / ``--quantize`` records by (path, name) (``Dequantizer.records``).
    A copy of a tensor computed from a pair of the virtual model keeps its box and reads one chunk file of
    the stored weight instead, and ``computed`` gains that tensor's record there (``chunk_record``: the
    stored weight and scale assembled from their chunks), which ``Dequantizer.attach`` then finds.

    Raises:
        UnsupportedError: A copy through a reshaping view of a chunked tensor.
    """
    virtual = os.path.join(os.path.abspath(opened.path), dcp.METADATA_NAME)
    interned, indexes = SourcePaths(), Indexes()
    records = computed if computed is not None else {}
    made = {name: q for (path, name), q in records.items() if path == virtual}
    made.update((q.name, q) for q in plan.quantized if q.path == virtual)
    moved_records: dict[str, QuantizedSource] = {}

    def record(name: str) -> QuantizedSource:
        if name not in moved_records:
            q = chunk_record(made[name], opened, indexes)
            moved_records[name] = records[(q.path, q.name)] = q
        return moved_records[name]

    def moved(t: TensorPlan) -> TensorPlan:
        copies: list[Copy] = []
        for c in t.copies:
            if plan.sources[c.source] != virtual:
                copies.append(replace(c, source=interned.id(plan.sources[c.source])))
            elif c.tensor in made:  # computed while copying: the box of the whole computed tensor, as planned
                copies.append(replace(c, source=interned.id(record(c.tensor).path)))
            else:
                copies.extend(_chunk_copies(c, opened.tensors[c.tensor], interned, indexes))
        return replace(t, copies=tuple(copies))

    files = tuple(replace(f, tensors=tuple(moved(t) for t in f.tensors)) for f in plan.files)
    quantized = tuple(record(q.name) if q.path == virtual else q for q in plan.quantized)
    return Plan(plan.operation, tuple(interned.paths), files, plan.texts, quantized)


def chunk_record(q: QuantizedSource, opened: OpenedChunks, indexes: Indexes | None = None) -> QuantizedSource:
    """``q`` (a pair of the virtual model) read from the chunks: its stored weight and (dequantizing) its
    stored scale assembled whole from theirs (``Assembled`` reads only the rows asked), at a data file
    holding a chunk of the weight (the copies' source, where ``execute.dequant.wrapped_opener`` answers)."""
    sources = SourcePaths()
    weight = opened.tensors[q.weight]
    assembled = assembled_tensor(sources, weight, tuple((0, n) for n in weight.shape), indexes=indexes)
    scale, scale_path = None, weight.files[0]
    if q.kind in (FP8_BLOCK, MXFP4):  # --quantize makes its scale; --dequantize reads the stored one
        stored = opened.tensors[q.scale]
        scale = assembled_tensor(sources, stored, tuple((0, n) for n in stored.shape), indexes=indexes)
        scale_path = stored.files[0]
    return replace(
        q,
        path=weight.files[0],
        scale_path=scale_path,
        assembled=assembled,
        assembled_sources=tuple(sources.paths),
        scale_assembled=scale,
    )


def boxed_dcp(
    plan: Plan,
    opened: OpenedChunks,
    folder: str,
    how: Chunking,
    notes: list[str],
    byte_items: Sequence[dcp.BytesItem] = (),
) -> Plan | None:
    """``plan`` (from ``virtual_model``, whole tensors) as a DCP checkpoint in ``folder`` planned from the
    chunk boxes at once (``plan.boxes.plan_boxes``: lazy files, one table per chunking; the ``.metadata``
    as columns, one table per chunking too: ``plan.dcp_chunks``), never as millions of copies of full
    tensors re-cut; None when a tensor is not a plain whole copy of a chunked one (a cast, a reshaping
    map: ``resourced`` then ``plan.dcp.dcp_plan`` plan it) or has two chunks in one data file.
    ``byte_items``: non-tensor values the ``.metadata`` also lists (a torch_dist output's)."""
    from reshard.plan.dcp_chunks import Placements, metadata_columns

    virtual = os.path.join(os.path.abspath(opened.path), dcp.METADATA_NAME)
    whole = _whole_copies(plan, virtual, opened)
    if whole is None or isinstance(how, SourceSlices):
        return None
    chunkings = Placements(how)
    placed, strings, known = [], [], set()
    for t, c in whole:
        if t.literal is not None or t.dtype is dtypes.STR:
            strings.append(t.name)
            continue
        assert c is not None, "only strings come without their copy"
        if t.dtype not in known:
            dtypes.torch_name(t.dtype)  # a dtype torch has none of: refused
            known.add(t.dtype)
        where = chunkings.of(t)
        if where is None:
            return None  # two chunks of one tensor in one file: the general re-cut plans it
        placed.append((t, c, where))
    if strings:
        notes.append(
            f"passed over {len(strings)} string entries (a DCP checkpoint holds tensors): {', '.join(strings)}"
        )
    if not placed:
        raise UnsupportedError("no tensor to write as a DCP checkpoint", folder)
    ranks = chunkings.ranks()
    targets = [Target(c.tensor, where.cells or (), t.name) for t, c, where in placed]
    outputs = [OutputFile(os.path.join(folder, data_file_name(r)), DISTCP, rank=r) for r in ranks]
    sources = [opened.tensors[n] for n in dict.fromkeys(c.tensor for _, c, _ in placed)]
    boxed = plan_boxes(sources, outputs, targets, plan.operation, chunk_names=True)
    metadata = metadata_columns(
        ((t.name, t.dtype, t.shape, where) for t, _, where in placed), ranks, folder, byte_items
    )
    return Plan(plan.operation, boxed.sources, boxed.files, (metadata,), plan.quantized)


def _whole_copies(plan: Plan, virtual: str, opened: OpenedChunks) -> list[tuple[TensorPlan, Copy | None]] | None:
    """Each tensor of ``plan`` with its one copy, when every copy is a whole chunked tensor of the same
    dtype, neither viewed nor permuted (None otherwise); strings come with no copy."""
    out: list[tuple[TensorPlan, Copy | None]] = []
    for t in (t for f in plan.files for t in f.tensors):
        if t.literal is not None or t.dtype is dtypes.STR:
            out.append((t, None))
            continue
        if len(t.copies) != 1:
            return None
        c = t.copies[0]
        source = opened.tensors.get(c.tensor)
        if (
            plan.sources[c.source] != virtual
            or source is None
            or source.dtype is not t.dtype
            or c.src_perm is not None
            or (c.src_view is not None and tuple(c.src_view) != source.shape)
            or tuple(c.lengths) != source.shape
            or t.shape != source.shape
        ):
            return None
        out.append((t, c))
    return out


def _chunk_copies(c: Copy, tensor: ChunkedTensor, interned: SourcePaths, indexes: Indexes) -> list[Copy]:
    """The copies from ``tensor``'s chunks that fill what copy ``c`` (of the whole tensor) fills."""
    if c.src_view is not None and tuple(c.src_view) != tensor.shape:
        return _viewed_chunk_copies(c, tensor, interned, indexes)
    perm = c.src_perm if c.src_perm is not None else tuple(range(len(c.lengths)))
    box = tuple((s, s + n) for s, n in zip(c.src_start, c.src_lengths, strict=True))
    piece_plan = assembled_tensor(interned, tensor, box, indexes=indexes)
    out = []
    for p in piece_plan.copies:
        # p.dst_start: the piece's place in ``box`` (source axes); c's destination is in its own axis order
        dst = tuple(c.dst_start[j] + p.dst_start[perm[j]] for j in range(len(perm)))
        lengths = tuple(p.lengths[perm[j]] for j in range(len(perm)))
        out.append(Copy(p.source, p.tensor, p.src_start, dst, lengths, p.whole_source, None, c.src_perm))
    return out


def _refused(tensor: ChunkedTensor) -> UnsupportedError:
    return UnsupportedError(
        f"tensor {tensor.name!r}: a model map that reshapes a tensor of a PyTorch DCP checkpoint into boxes that "
        "are not boxes of its chunks is not supported (convert it to safetensors first: reshard transform SRC "
        "FULL --output-format safetensors)"
    )


def _viewed_chunk_copies(c: Copy, tensor: ChunkedTensor, interned: SourcePaths, indexes: Indexes) -> list[Copy]:
    """``_chunk_copies`` of a copy reading ``tensor`` through a view (``plan.views``): the view's box as a box
    of the tensor, each chunk's piece read through the same view of the chunk."""
    from reshard.plan import views

    merged = views.runs(c.src_view or (), tensor.shape)
    box = None if merged is None else views.to_tensor(merged, tensor.shape, c.src_start, c.src_lengths)
    if merged is None or box is None:
        raise _refused(tensor)
    start, lengths = box
    plan = assembled_tensor(
        interned, tensor, tuple((s, s + n) for s, n in zip(start, lengths, strict=True)), indexes=indexes
    )
    chunk_shapes = {
        (tensor.files[k], tensor.tensor_of(k)): tuple(hi - lo for lo, hi in b) for k, b in enumerate(tensor.boxes)
    }
    perm = c.src_perm if c.src_perm is not None else tuple(range(len(c.lengths)))
    out = []
    for p in plan.copies:
        chunk_shape = chunk_shapes[(interned.paths[p.source], p.tensor)]
        at = tuple(s + d for s, d in zip(start, p.dst_start, strict=True))
        in_view = views.to_view(merged, tensor.shape, at, p.lengths)
        in_chunk = views.to_view(merged, chunk_shape, p.src_start, p.lengths)
        if in_view is None or in_chunk is None:
            raise _refused(tensor)
        offset = tuple(v - s for v, s in zip(in_view[0], c.src_start, strict=True))
        dst = tuple(c.dst_start[j] + offset[perm[j]] for j in range(len(perm)))
        sizes = tuple(in_view[1][perm[j]] for j in range(len(perm)))
        chunk_view = views.viewed_shape(merged, chunk_shape)
        out.append(Copy(p.source, p.tensor, in_chunk[0], dst, sizes, False, chunk_view, c.src_perm))
    return out


def full_plan(
    files: dict[str, SourceFile], mapping: dict[str, str], dst: str, shard_size: int | None
) -> tuple[Plan, str]:
    """A full model of the virtual source in one safetensors file, or Hugging Face shards; and what the
    output is called in a note."""
    plan = plan_transform_full(files, mapping, None, dst, "", "safetensors")
    if shard_size is None:
        return plan, "a safetensors output"
    return hf_sharded(plan, dst, shard_size), "a Hugging Face output"


def parts_plan(
    files: dict[str, SourceFile], mapping: dict[str, str], dst: str, choice_func: Callable[[str], object] | None
) -> Plan:
    """unify's parts of a full model: ``part<j>.safetensors`` packed as MindSpore packs them, and
    ``param_name_map.json`` (every tensor of a DCP checkpoint is a parameter: no hyper-parameter file)."""
    sizes: dict[str, int] = {}
    renamed: dict[str, str] = {}
    for name, key in mapping.items():
        choice = _choice(choice_func, name)
        if choice is False:
            continue
        if isinstance(choice, str):
            renamed[name] = choice
        sizes[name] = files[key].tensors[name].nbytes
    total = sum(sizes.values())
    groups = _bin_pack(list(sizes.items()), max(1, min(math.ceil(total / PART_BYTES), len(sizes))) if sizes else 1)
    interned = SourcePaths()
    parts: list[FilePlan] = []
    for j, group in enumerate(groups):
        tensors = tuple(whole_tensor(interned, files[mapping[n]], n, renamed.get(n, n)) for n in group)
        parts.append(FilePlan(os.path.join(dst, f"part{j}.safetensors"), "safetensors", tensors, (("format", "ms"),)))
    weight_map = {renamed.get(n, n): f"part{j}.safetensors" for j, g in enumerate(groups) for n in g}
    import json

    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=4)
    return Plan(
        "unify", tuple(interned.paths), tuple(parts), (TextOutput(os.path.join(dst, "param_name_map.json"), text),)
    )


def saving_ranks(opened: OpenedChunks, paths: Sequence[str]) -> list[int]:
    """The ranks that saved the data files ``paths`` (``rank-list --files``, ``inspect``)."""
    return sorted({opened.saved_by[p] for p in paths if p in opened.saved_by})


def chunk_facts(opened: OpenedChunks) -> dict[str, Any]:
    """What a chunked source holds, as plain data (``inspect``'s view, read from ``.metadata`` alone):
    each tensor's global shape, chunks, data files and saving ranks; each data file's rank, size and
    chunks; the non-tensor values; the bytes each rank saved."""
    folder = os.path.abspath(opened.path)
    relative = {p: os.path.relpath(p, folder) for p in opened.files}  # once a file, not once a chunk
    per_file: dict[str, dict[str, int]] = {p: {"chunks": 0, "chunk_bytes": 0} for p in opened.files}
    rank_bytes: dict[int, int] = {}
    rows: list[dict[str, Any]] = []
    for name, t in opened.tensors.items():
        for box, path in zip(t.boxes, t.files, strict=True):
            held = math.prod(b - a for a, b in box) * t.dtype.itemsize
            per_file[path]["chunks"] += 1
            per_file[path]["chunk_bytes"] += held
            rank = opened.saved_by[path]
            rank_bytes[rank] = rank_bytes.get(rank, 0) + held
        used = list(dict.fromkeys(t.files))
        rows.append(
            {
                "name": name,
                "dtype": t.dtype.ms_name,
                "shape": list(t.shape),
                "bytes": math.prod(t.shape) * t.dtype.itemsize,
                "chunks": len(t.boxes),
                "files": [relative[p] if p in relative else os.path.relpath(p, folder) for p in used],
                "saved_by": saving_ranks(opened, used),
            }
        )
    files = [
        {"name": relative[p], "rank": opened.saved_by[p], "bytes": os.path.getsize(p), **per_file[p]}
        for p in opened.files
    ]
    values = [
        {"name": v.name, "file": os.path.relpath(v.file, folder), "bytes": v.length} for v in opened.values.values()
    ]
    return {
        "kind": "dcp",
        "format": opened.fmt,
        "path": opened.path,
        "ranks": len(set(opened.saved_by.values())),
        "tensors": rows,
        "files": files,
        "values": values,
        "bytes": sum(r["bytes"] for r in rows),
        "rank_bytes": {str(r): b for r, b in sorted(rank_bytes.items())},
    }


__all__ = [
    "VALUES_NOT_CARRIED",
    "VIRTUAL",
    "boxed_dcp",
    "check_run",
    "chunk_facts",
    "chunk_record",
    "full_plan",
    "parts_plan",
    "resourced",
    "saving_ranks",
    "values_note",
    "virtual_model",
]
