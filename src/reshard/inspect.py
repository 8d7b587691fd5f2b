"""``reshard inspect``: what is in a checkpoint file, a rank-folder tree, a Hugging Face sharded
model, or a strategy file.

Reads headers only (tensor data is never touched), so inspecting a 1 TB checkpoint is instant.
With a strategy, each sharded parameter also shows its full shape and layout.
"""

from __future__ import annotations

import json
import os
from typing import Any

from reshard import layout
from reshard.errors import ReshardError
from reshard.formats import layout_dir
from reshard.formats.strategy import ParamLayout, StrategyFile, layout_map, load_strategy, read_strategy

STRATEGY_FIRST_BYTE = 0x08  # ParallelStrategyMap starts with current_stage (field 1, varint)


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


def checkpoint_rows(path: str, strategy: StrategyFile | None = None) -> list[dict[str, Any]]:
    from reshard.api import source_file

    src = source_file(path)
    lmap = layout_map(strategy) if strategy is not None else {}
    rows = []
    for name, t in src.tensors.items():
        row: dict[str, Any] = {"name": name, "dtype": t.dtype.ms_name, "shape": list(t.shape), "bytes": t.nbytes}
        if name in lmap:
            p = lmap[name].layout
            row["layout"] = describe_layout(p)
            row["full_shape"] = list(layout.full_shape(p, t.shape))
            row["stages"] = list(lmap[name].stages)
        if name in src.strings:
            row["value"] = src.strings[name]
        rows.append(row)
    return rows


def strategy_rows(sf: StrategyFile) -> list[dict[str, Any]]:
    return [
        {"name": name, "stages": list(s.stages), "layout": describe_layout(s.layout),
         "devices": s.layout.device_num}
        for name, s in layout_map(sf).items()
    ]


def full_model_info(path: str, strategy: StrategyFile | None = None) -> dict[str, Any]:
    """A Hugging Face sharded model (folder or index file) as one checkpoint; rows name their shard."""
    from reshard.api import unified_index

    files, _, hyper = unified_index(path)
    parts = [*files.values(), *([hyper] if hyper is not None else [])]
    rows = [{**row, "file": os.path.basename(part.path)}
            for part in parts for row in checkpoint_rows(part.path, strategy)]
    return {"kind": "checkpoint", "format": "safetensors", "path": path, "files": [p.path for p in parts],
            "tensors": rows, "bytes": sum(r["bytes"] for r in rows)}


def gather(path: str, strategy: str | None = None) -> dict[str, Any]:
    sf = load_strategy(strategy) if strategy else None
    from reshard.api import is_hf_model

    if is_hf_model(path):
        return full_model_info(path, sf)
    if os.path.isdir(path):
        if layout_dir.rank_dirs(path):
            fmt, chosen = layout_dir.collect_rank_files(path)
            ranks = {}
            for rank, picked in chosen.items():
                rows = checkpoint_rows(picked.path, sf)
                ranks[rank] = {"file": picked.path, "ignored": list(picked.ignored), "tensors": rows,
                               "bytes": sum(r["bytes"] for r in rows)}
            return {"kind": "distributed", "format": fmt, "path": path, "ranks": ranks,
                    "bytes": sum(r["bytes"] for r in ranks.values())}
        sf_dir = load_strategy(path)
        return {"kind": "strategy", "path": path, "params": strategy_rows(sf_dir)}
    if _is_strategy(path):
        return {"kind": "strategy", "path": path, "params": strategy_rows(read_strategy(path))}
    rows = checkpoint_rows(path, sf)
    return {"kind": "checkpoint", "format": layout_dir.detect_format(path), "path": path, "tensors": rows,
            "bytes": sum(r["bytes"] for r in rows)}


def _size(n: int) -> str:
    from reshard.cli import _size as fmt

    return fmt(n)


def main(path: str, as_json: bool = False, strategy: str | None = None) -> None:
    info = gather(path, strategy)
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
            table.add_row(row["name"], str(row["stages"]), str(row["devices"]), row["layout"])
        console.print(table)
        console.print(f"{len(info['params'])} parameters")
        return
    groups = list(info["ranks"].items()) if info["kind"] == "distributed" else [(None, info)]
    for rank, part in groups:
        title = f"rank {rank}: {part['file']}" if rank is not None else f"{info['format']} {path}"
        table = Table(title=title)
        for col in ("name", "dtype", "shape", "size", "full shape", "layout"):
            table.add_column(col, justify="right" if col == "size" else "left")
        for row in part["tensors"]:
            shape = repr(row["value"]) if "value" in row else str(row["shape"])
            table.add_row(row["name"], row["dtype"], shape, _size(row["bytes"]),
                          str(row.get("full_shape", "")), row.get("layout", ""))
        console.print(table)
        if part.get("ignored"):
            console.print(f"ignored: {', '.join(part['ignored'])}")
    count = sum(len(p["tensors"]) for _, p in groups)
    console.print(f"{count} tensors, {_size(info['bytes'])} in {len(info.get('files', groups))} file(s)")
