"""``reshard inspect``: what is in anything the other commands read.

A checkpoint file (plain or encrypted), a folder holding one, a single ``rank_<r>`` folder, a
rank-folder tree, a unified folder (``part*.safetensors`` + ``param_name_map.json``), a Hugging
Face sharded model, a strategy file, or a folder of per-stage strategy files.

Reads headers only (tensor data is never touched), so inspecting a 1 TB checkpoint is instant.
With a strategy, each sharded parameter also shows its full shape and layout. A parameter shared
by pipeline stages (an embedding used by the first and the last stage) may have a different
layout in each stage, so a rank's layout and full shape come from *that rank's* stage
(``rank // devices per stage``); a per-stage strategy file lists the stage it belongs to.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import replace
from typing import Any

from reshard import layout
from reshard.errors import UsageError
from reshard.formats import layout_dir
from reshard.formats.strategy import StrategyFile, load_strategy
from reshard.layout import STAGE_SEPARATOR, ParamLayout, device_num, layout_map
from reshard.sources import (
    CHECKPOINT2,
    HUGGING_FACE,
    ONE_RANK_FOLDER,
    RANK_FOLDERS,
    STRATEGY,
    UNIFIED,
    full_model_file,
    identify,
    is_encrypted,
    source_file,
    unified_index,
)
from reshard.sources.checkpoint2 import check_iteration
from reshard.text import format_size, one_line

_RANK_FOLDER = re.compile(r"rank_(\d+)")

# name -> (the layout that applies, every stage holding the parameter)
Layouts = dict[str, tuple[ParamLayout, list[int]]]


def describe_layout(p: ParamLayout) -> str:
    text = f"dev {list(p.dev_matrix)} map {[list(e) if isinstance(e, tuple) else e for e in p.tensor_map]}"
    if p.opt_shard_size:
        text += f" opt {p.opt_shard_step}/{p.opt_shard_size}"
    return text


def _is_merged(sf: StrategyFile) -> bool:
    return any(STAGE_SEPARATOR in name for name in sf.layouts)


def param_layouts(sf: StrategyFile, rank: int | None = None) -> Layouts:
    """Each parameter's layout as seen by ``rank`` (None: its first stage's), and its stages.

    A merged strategy holds one layout per stage (``"0-emb"``, ``"1-emb"``): the rank's stage picks
    it. A per-stage file holds one stage's layouts, unprefixed: they are that file's stage.
    """
    lmap = layout_map(sf)
    if not _is_merged(sf):
        own_stage = sf.stage or 0
        return {name: (staged.layout, [own_stage]) for name, staged in lmap.items()}
    stage = rank // device_num(sf) if rank is not None else None
    found: Layouts = {}
    for name, staged in lmap.items():
        own = sf.layouts.get(f"{stage}{STAGE_SEPARATOR}{name}") if stage is not None else None
        found[name] = (own or staged.layout, list(staged.stages))
    return found


def stage_layouts(sf: StrategyFile, name: str) -> dict[int, ParamLayout]:
    """Every stage's layout of one parameter of a merged strategy."""
    prefix = f"{STAGE_SEPARATOR}{name}"
    return {
        int(key[: -len(prefix)]): p
        for key, p in sf.layouts.items()
        if key.endswith(prefix) and key[: -len(prefix)].isdigit()
    }


def _read_for(path: str, read: Any) -> Any:
    """The read options for one file: the key only for an encrypted ``.ckpt``."""
    if read is None or read.dec_key is None:
        return replace(read, dec_key=None) if read is not None else None
    return read if is_encrypted(path) else replace(read, dec_key=None)


def checkpoint_rows(
    path: str, strategy: StrategyFile | None = None, rank: int | None = None, read: Any = None
) -> list[dict[str, Any]]:
    src = source_file(path, rank or 0, _read_for(path, read))
    lmap = param_layouts(strategy, rank) if strategy is not None else {}
    rows = []
    for name, t in src.tensors.items():
        row: dict[str, Any] = {"name": name, "dtype": t.dtype.ms_name, "shape": list(t.shape), "bytes": t.nbytes}
        if name in lmap:
            p, stages = lmap[name]
            row["layout"] = describe_layout(p)
            row["full_shape"] = list(layout.full_shape(p, t.shape))
            row["stages"] = stages
        if name in src.strings:
            row["value"] = src.strings[name]
        rows.append(row)
    return rows


def strategy_rows(sf: StrategyFile) -> list[dict[str, Any]]:
    rows = []
    merged = _is_merged(sf)
    for name, (p, stages) in param_layouts(sf).items():
        row: dict[str, Any] = {"name": name, "stages": stages, "layout": describe_layout(p), "devices": p.device_num}
        per_stage = stage_layouts(sf, name) if merged else {}
        if len({describe_layout(q) for q in per_stage.values()}) > 1:
            row["stage_layouts"] = {str(s): describe_layout(q) for s, q in sorted(per_stage.items())}
        rows.append(row)
    return rows


def full_model_info(path: str, strategy: StrategyFile | None = None) -> dict[str, Any]:
    """A Hugging Face sharded model or a unified folder as one checkpoint; rows name their file."""
    files, _, hyper = unified_index(path)
    parts = [*files.values(), *([hyper] if hyper is not None else [])]
    rows = [
        {**row, "file": os.path.basename(part.path)} for part in parts for row in checkpoint_rows(part.path, strategy)
    ]
    return {
        "kind": "checkpoint",
        "format": "safetensors",
        "path": path,
        "files": [p.path for p in parts],
        "tensors": rows,
        "bytes": sum(r["bytes"] for r in rows),
    }


def _file_info(path: str, sf: StrategyFile | None, read: Any, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """One checkpoint file; a file inside a ``rank_<r>`` folder is that rank (for its stage's layouts)."""
    match = _RANK_FOLDER.fullmatch(os.path.basename(os.path.dirname(os.path.abspath(path))))
    rank = int(match.group(1)) if match else None
    rows = checkpoint_rows(path, sf, rank, read)
    info = {
        "kind": "checkpoint",
        "format": layout_dir.detect_format(path),
        "path": path,
        "tensors": rows,
        "bytes": sum(r["bytes"] for r in rows),
    }
    if rank is not None:
        info["rank"] = rank
    if ignored:
        info["ignored"] = list(ignored)
    return info


def _distributed_info(path: str, sf: StrategyFile | None, read: Any) -> dict[str, Any]:
    fmt, chosen = layout_dir.collect_rank_files(path)
    ranks = {}
    for rank, picked in chosen.items():
        rows = checkpoint_rows(picked.path, sf, rank, read)
        ranks[rank] = {
            "file": picked.path,
            "ignored": list(picked.ignored),
            "tensors": rows,
            "bytes": sum(r["bytes"] for r in rows),
        }
    return {
        "kind": "distributed",
        "format": fmt,
        "path": path,
        "ranks": ranks,
        "bytes": sum(r["bytes"] for r in ranks.values()),
    }


def _rank_folder_info(path: str, sf: StrategyFile | None, read: Any) -> dict[str, Any]:
    """One ``rank_<r>`` folder: the file MindSpore's rule picks for its format, as that rank."""
    checkpoints = layout_dir.files_in(path, "ckpt") + layout_dir.files_in(path, "safetensors")
    fmts = {layout_dir.detect_format(f) for f in checkpoints}
    if len(fmts) > 1:
        raise UsageError("the rank folder holds both .ckpt and .safetensors files; inspect one of them", path)
    fmt = fmts.pop()
    picked = layout_dir.pick_file(path, fmt, "name" if fmt == "ckpt" else "numbers")
    assert picked is not None  # the registry recognised a rank folder holding checkpoints
    return _file_info(picked.path, sf, read, picked.ignored)


def _strategy_info(path: str, notes: list[str]) -> dict[str, Any]:
    opened = STRATEGY.open(path, None, notes)
    assert opened.strategy is not None
    return {"kind": "strategy", "path": path, "params": strategy_rows(opened.strategy)}


def gather(path: str, strategy: str | None = None, read: Any = None, notes: list[str] | None = None) -> dict[str, Any]:
    """What ``path`` holds, as plain data (the ``--json`` output); loading notes go to ``notes``.

    What ``path`` is comes from the source registry (``reshard.sources.registry``), which also
    words every "missing / empty / not something reshard reads" error.
    """
    notes = notes if notes is not None else []
    kind = identify(path)
    check_iteration(path, kind, read)
    if kind is CHECKPOINT2:
        if strategy:
            raise UsageError(
                "a MindFormers Checkpoint 2.0 carries its layouts in metadata.json: give no strategy", path
            )
        return checkpoint2_info(path, read, notes)
    sf = load_strategy(strategy) if strategy else None
    if sf is not None:
        notes.extend(sf.notes)
    if kind in (HUGGING_FACE, UNIFIED):
        return full_model_info(path, sf)
    if kind is RANK_FOLDERS:
        return _distributed_info(path, sf, read)
    if kind is ONE_RANK_FOLDER:
        return _rank_folder_info(path, sf, read)
    if kind is STRATEGY:
        return _strategy_info(path, notes)
    single = full_model_file(path)  # a checkpoint file (plain or encrypted), or a folder holding one
    assert single is not None
    return _file_info(single, sf, read)


def checkpoint2_info(path: str, read: Any = None, notes: list[str] | None = None) -> dict[str, Any]:
    """A MindFormers Checkpoint 2.0: each tensor's global shape, dtype, layout and files, the files, and
    ``common.json`` (docs/formats.md §13). Every fact is cross-checked as a transform would."""
    from reshard.sources.checkpoint2 import open_checkpoint2, read_iteration

    notes = notes if notes is not None else []
    it = read_iteration(path, read, notes)
    opened = open_checkpoint2(path, read, [], CHECKPOINT2.name, it)  # the same checks a transform makes
    tensors: list[dict[str, Any]] = []
    if it.metadata is None:
        for file_name, facts in it.headers.items():
            for name, t in facts.tensors.items():
                tensors.append(_cp2_row(name, t.dtype.ms_name, t.shape, None, None, [file_name], t.nbytes))
    else:
        for name, meta in it.metadata.tensors.items():
            files = sorted({r.file_name for (n, _), recs in it.metadata.storage.items() if n == name for r in recs})
            nbytes = math.prod(meta.global_shape) * meta.dtype.itemsize
            tensors.append(_cp2_row(name, meta.dtype.ms_name, meta.global_shape, meta, len(meta.chunks), files, nbytes))
    return {
        "kind": "checkpoint2",
        "path": path,
        "iteration_folder": it.folder,
        "format": "safetensors",
        "ranks": len(opened.ranks),
        "tensors": tensors,
        "files": [
            {"name": n, "bytes": os.path.getsize(f.path), "tensors": len(f.tensors)} for n, f in it.headers.items()
        ],
        "common": it.common,
        "bytes": sum(t["bytes"] for t in tensors),
    }


def _cp2_row(
    name: str, dtype: str, shape: tuple[int, ...], meta: Any, chunks: int | None, files: list[str], nbytes: int
) -> dict[str, Any]:
    lay = meta.layout if meta is not None else None
    layout_json = None
    if lay is not None:
        layout_json = {
            "device_matrix": list(lay.device_matrix),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in lay.tensor_map],
            "alias_name": list(lay.alias_name),
            "rank_list": list(lay.rank_list),
        }
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(shape),
        "bytes": nbytes,
        "layout": layout_json,
        "axis_fragmentations": list(meta.axis_fragmentations) if meta is not None else [1] * len(shape),
        "chunks": chunks if chunks is not None else 1,
        "files": files,
    }


def _print_checkpoint2(info: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"MindFormers Checkpoint 2.0 {info['iteration_folder']} ({info['ranks']} ranks)")
    for col in ("name", "dtype", "global shape", "layout", "chunks", "files"):
        table.add_column(col)
    for row in info["tensors"]:
        lay = row["layout"]
        shown = (
            f"dev {lay['device_matrix']} map {lay['tensor_map']} ranks {_ranks_text(lay['rank_list'])}" if lay else ""
        )
        files = row["files"]
        table.add_row(
            row["name"], row["dtype"], str(row["shape"]), shown, str(row["chunks"]),
            files[0] if len(files) == 1 else f"{len(files)} files",
        )  # fmt: skip
    console.print(table)
    files = Table(title="files")
    for col in ("file", "tensors", "size"):
        files.add_column(col, justify="left" if col == "file" else "right")
    for f in info["files"]:
        files.add_row(f["name"], str(f["tensors"]), format_size(f["bytes"]))
    console.print(files)
    common = info["common"]
    console.print("common.json: " + (", ".join(f"{k}={v}" for k, v in common.items()) if common else "none"))
    console.print(f"{len(info['tensors'])} tensors, {format_size(info['bytes'])} in {len(info['files'])} file(s)")


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def main(path: str, as_json: bool = False, strategy: str | None = None, read: Any = None) -> None:
    notes: list[str] = []
    info = gather(path, strategy, read, notes)
    for note in notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if info["kind"] == "checkpoint2":
        _print_checkpoint2(info, console)
        return
    if info["kind"] == "strategy":
        table = Table(title=f"strategy {path}")
        for col in ("name", "stages", "devices", "layout"):
            table.add_column(col)
        for row in info["params"]:
            shown = row["layout"]
            if "stage_layouts" in row:
                shown = "; ".join(f"stage {s}: {text}" for s, text in row["stage_layouts"].items())
            table.add_row(row["name"], str(row["stages"]), str(row["devices"]), shown)
        console.print(table)
        console.print(f"{len(info['params'])} parameters")
        return
    groups = list(info["ranks"].items()) if info["kind"] == "distributed" else [(info.get("rank"), info)]
    for rank, part in groups:
        file = part["file"] if "file" in part else part["path"]
        title = f"rank {rank}: {file}" if rank is not None else f"{info['format']} {path}"
        table = Table(title=title)
        for col in ("name", "dtype", "shape", "size", "full shape", "layout"):
            table.add_column(col, justify="right" if col == "size" else "left")
        for row in part["tensors"]:
            shape = repr(row["value"]) if "value" in row else str(row["shape"])
            table.add_row(
                row["name"],
                row["dtype"],
                shape,
                format_size(row["bytes"]),
                str(row.get("full_shape", "")),
                row.get("layout", ""),
            )
        console.print(table)
        if part.get("ignored"):
            console.print(f"ignored: {', '.join(part['ignored'])}")
    count = sum(len(p["tensors"]) for _, p in groups)
    console.print(f"{count} tensors, {format_size(info['bytes'])} in {len(info.get('files', groups))} file(s)")


__all__ = [
    "Layouts",
    "checkpoint2_info",
    "checkpoint_rows",
    "describe_layout",
    "full_model_info",
    "gather",
    "main",
    "param_layouts",
    "stage_layouts",
    "strategy_rows",
]
