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
import os
import re
import sys
from dataclasses import replace
from typing import Any

from reshard import layout
from reshard.errors import ReshardError, UsageError
from reshard.formats import layout_dir
from reshard.formats.ckpt import probe_ckpt
from reshard.formats.strategy import (
    STAGE_SEPARATOR,
    ParamLayout,
    StrategyFile,
    device_num,
    layout_map,
    load_strategy,
    read_strategy,
)
from reshard.text import format_size, one_line

STRATEGY_FIRST_BYTE = 0x08  # ParallelStrategyMap starts with current_stage (field 1, varint)
_RANK_FOLDER = re.compile(r"rank_(\d+)")
_INDEX_NAMES = ("param_name_map.json", "model.safetensors.index.json")  # JSON that is not a strategy

# name -> (the layout that applies, every stage holding the parameter)
Layouts = dict[str, tuple[ParamLayout, list[int]]]


def _is_strategy(path: str) -> bool:
    """Strategy file or checkpoint? Decided by the first byte, so a multi-GB .ckpt is never read."""
    if path.endswith(".json"):
        return True
    if not path.endswith(".ckpt") or not os.path.isfile(path):
        return False
    with open(path, "rb") as fh:
        first = fh.read(1)
    if first != bytes([STRATEGY_FIRST_BYTE]):
        return False
    try:
        read_strategy(path)
    except ReshardError:  # not a strategy after all: report it as a checkpoint problem
        return False
    return True


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
        stage = sf.stage or 0
        return {name: (staged.layout, [stage]) for name, staged in lmap.items()}
    stage = rank // device_num(sf) if rank is not None else None
    found: Layouts = {}
    for name, staged in lmap.items():
        own = sf.layouts.get(f"{stage}{STAGE_SEPARATOR}{name}") if stage is not None else None
        found[name] = (own or staged.layout, list(staged.stages))
    return found


def stage_layouts(sf: StrategyFile, name: str) -> dict[int, ParamLayout]:
    """Every stage's layout of one parameter of a merged strategy."""
    prefix = f"{STAGE_SEPARATOR}{name}"
    return {int(key[: -len(prefix)]): p for key, p in sf.layouts.items()
            if key.endswith(prefix) and key[: -len(prefix)].isdigit()}


def read_for_file(path: str | None, read: Any) -> Any:
    """The read options for one file: the key only for an encrypted ``.ckpt`` (so one key can serve
    a command whose other inputs are plain)."""
    if read is None or read.dec_key is None or path is None or not path.endswith(".ckpt"):
        return replace(read, dec_key=None) if read is not None else None
    try:
        encrypted = probe_ckpt(path).cipher is not None
    except OSError:
        encrypted = False  # the reader reports it
    return read if encrypted else replace(read, dec_key=None)


def checkpoint_rows(path: str, strategy: StrategyFile | None = None, rank: int | None = None,
                    read: Any = None) -> list[dict[str, Any]]:
    from reshard.api import source_file

    src = source_file(path, rank or 0, read_for_file(path, read))
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
        row: dict[str, Any] = {"name": name, "stages": stages, "layout": describe_layout(p),
                               "devices": p.device_num}
        per_stage = stage_layouts(sf, name) if merged else {}
        if len({describe_layout(q) for q in per_stage.values()}) > 1:
            row["stage_layouts"] = {str(s): describe_layout(q) for s, q in sorted(per_stage.items())}
        rows.append(row)
    return rows


def full_model_info(path: str, strategy: StrategyFile | None = None) -> dict[str, Any]:
    """A Hugging Face sharded model or a unified folder as one checkpoint; rows name their file."""
    from reshard.api import unified_index

    files, _, hyper = unified_index(path)
    parts = [*files.values(), *([hyper] if hyper is not None else [])]
    rows = [{**row, "file": os.path.basename(part.path)}
            for part in parts for row in checkpoint_rows(part.path, strategy)]
    return {"kind": "checkpoint", "format": "safetensors", "path": path, "files": [p.path for p in parts],
            "tensors": rows, "bytes": sum(r["bytes"] for r in rows)}


def _file_info(path: str, sf: StrategyFile | None, read: Any, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """One checkpoint file; a file inside a ``rank_<r>`` folder is that rank (for its stage's layouts)."""
    match = _RANK_FOLDER.fullmatch(os.path.basename(os.path.dirname(os.path.abspath(path))))
    rank = int(match.group(1)) if match else None
    rows = checkpoint_rows(path, sf, rank, read)
    info = {"kind": "checkpoint", "format": layout_dir.detect_format(path), "path": path, "tensors": rows,
            "bytes": sum(r["bytes"] for r in rows)}
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
        ranks[rank] = {"file": picked.path, "ignored": list(picked.ignored), "tensors": rows,
                       "bytes": sum(r["bytes"] for r in rows)}
    return {"kind": "distributed", "format": fmt, "path": path, "ranks": ranks,
            "bytes": sum(r["bytes"] for r in ranks.values())}


def _folder_info(path: str, sf: StrategyFile | None, read: Any, notes: list[str]) -> dict[str, Any]:
    if layout_dir.rank_dirs(path):
        return _distributed_info(path, sf, read)
    try:
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError as exc:
        raise UsageError(f"cannot list the folder: {exc.strerror}", path) from None
    if not names:
        raise UsageError("the folder is empty", path)
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    checkpoints = [f for f in files if f.endswith((".ckpt", ".safetensors")) and not _is_strategy(f)]
    strategies = [f for f in files if f.endswith((".ckpt", ".json")) and os.path.basename(f) not in _INDEX_NAMES
                  and _is_strategy(f)]
    if not checkpoints and strategies:
        found = load_strategy(path)
        notes.extend(found.notes)
        return {"kind": "strategy", "path": path, "params": strategy_rows(found)}
    if _RANK_FOLDER.fullmatch(os.path.basename(os.path.abspath(path))) and checkpoints:
        fmts = {layout_dir.detect_format(f) for f in checkpoints}
        if len(fmts) > 1:
            raise UsageError("the rank folder holds both .ckpt and .safetensors files; inspect one of them", path)
        picked = layout_dir.pick_file(path, fmts.pop(), "name" if checkpoints[0].endswith(".ckpt") else "numbers")
        if picked is not None:
            return _file_info(picked.path, sf, read, picked.ignored)
    if len(checkpoints) == 1:
        return _file_info(checkpoints[0], sf, read)
    if any(f.endswith(".safetensors") for f in checkpoints):
        return full_model_info(path, sf)
    if checkpoints:
        raise UsageError(f"the folder holds {len(checkpoints)} checkpoint files and no rank_<r> folders; "
                         "inspect one of them", path)
    raise UsageError("the folder holds no checkpoint or strategy files", path)


def gather(path: str, strategy: str | None = None, read: Any = None,
           notes: list[str] | None = None) -> dict[str, Any]:
    """What ``path`` holds, as plain data (the ``--json`` output); loading notes go to ``notes``."""
    from reshard.api import is_hf_model

    notes = notes if notes is not None else []
    if not os.path.exists(path):
        raise UsageError("does not exist", path)
    sf = load_strategy(strategy) if strategy else None
    if sf is not None:
        notes.extend(sf.notes)
    if is_hf_model(path):
        return full_model_info(path, sf)
    if os.path.isdir(path):
        return _folder_info(path, sf, read, notes)
    if _is_strategy(path):
        return {"kind": "strategy", "path": path, "params": strategy_rows(read_strategy(path))}
    return _file_info(path, sf, read)


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
            table.add_row(row["name"], row["dtype"], shape, format_size(row["bytes"]),
                          str(row.get("full_shape", "")), row.get("layout", ""))
        console.print(table)
        if part.get("ignored"):
            console.print(f"ignored: {', '.join(part['ignored'])}")
    count = sum(len(p["tensors"]) for _, p in groups)
    console.print(f"{count} tensors, {format_size(info['bytes'])} in {len(info.get('files', groups))} file(s)")
